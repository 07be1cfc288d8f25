#!/usr/bin/env bash
# image/ stage: what its tests need on a fresh Debian CI machine (as root): a docker daemon for the
# image builds, mmdebstrap for the Debian base, lxc to boot the template, skopeo to read the OCI
# archive, zstd for the template. dockerd runs without networking: the builds are offline by design.
set -euo pipefail
apt-get install -y -qq --no-install-recommends docker.io mmdebstrap lxc skopeo zstd tar ca-certificates >/dev/null
if ! docker info >/dev/null 2>&1; then
  setsid nohup dockerd --iptables=false --ip-masq=false --bridge=none >/var/log/dflash-dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  docker info >/dev/null 2>&1 || { echo "dockerd did not start:"; tail -20 /var/log/dflash-dockerd.log; exit 1; }
fi
echo "docker $(docker version --format '{{.Server.Version}}') ready; $(mmdebstrap --version); lxc $(lxc-start --version)"
