# The Proxmox VE test host (tests/pve_testhost): a PVE API + LXC + SSH stand-in for the provisioning tests.
TESTHOST_DIR ?= build/testhost

.PHONY: testhost-up testhost-down

testhost-up: venv ## start the PVE test host (root); connection info in build/testhost/connection.json
	$(PY) -m tests.pve_testhost up --state-dir $(TESTHOST_DIR)

testhost-down: venv ## stop the PVE test host; removes every container it made
	$(PY) -m tests.pve_testhost down --state-dir $(TESTHOST_DIR)
