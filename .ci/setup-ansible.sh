#!/usr/bin/env bash
# Provisioning tests (tests/test_provision_*.py): the modules reach the Proxmox test host with the
# system ssh client. Everything else they need comes from pip (the control and test extras).
set -euo pipefail
apt-get install -y -qq --no-install-recommends openssh-client >/dev/null
