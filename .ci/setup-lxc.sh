#!/usr/bin/env bash
# The PVE test host (tests/pve_testhost) runs real LXC containers and its own sshd; it starts both
# itself when a test asks for it, so nothing is started here. busybox-static makes the tiny CT rootfs.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends \
  lxc uidmap openssh-server openssh-client busybox-static zstd tar util-linux iproute2 >/dev/null
# Debian's openssh-server would start the machine's own sshd under an init; the test host runs its
# own on a free port with its own config, so the machine's one is not needed.
mkdir -p /run/sshd
