"""Shared pytest fixtures."""

import pytest


# --- Proxmox VE test host (tests/pve_testhost, issue 5) -----------------------------------------
@pytest.fixture(scope="session")
def pve_host(tmp_path_factory):
    """A PVE node stand-in: HTTPS API, real LXC containers, SSH with pct (see tests/pve_testhost/README.md)."""
    from tests.pve_testhost.fixture import pve_host_session

    yield from pve_host_session(tmp_path_factory.mktemp("pve-testhost"))
