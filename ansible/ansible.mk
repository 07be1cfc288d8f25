# Provisioning stage: `make provision` creates and configures the GPU training containers of the
# inventory on Proxmox VE (ansible/provision.yml). Included by the top-level Makefile.
INVENTORY ?= inventory/example/hosts.yml
# Extra ansible-playbook arguments, e.g. ARGS="--limit trainer1 --ask-vault-pass".
ARGS ?=
ANSIBLE_ENV := ANSIBLE_CONFIG=ansible/ansible.cfg
ANSIBLE_PLAYBOOK := $(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY) ansible/provision.yml

.PHONY: provision provision-check lint-ansible inventory-doc

provision: venv ## create/update the GPU containers of INVENTORY (ARGS="--check --diff" to preview)
	$(ANSIBLE_PLAYBOOK) $(ARGS)

provision-check: venv ## what `make provision` would change, changing nothing (--check --diff)
	$(ANSIBLE_PLAYBOOK) --check --diff $(ARGS)

# The settings' documentation: every role's settings, descriptions from meta/argument_specs.yml, defaults from
# defaults/main.yml; the values the file sets are kept (tests/test_inventory_doc.py checks it is current).
INVENTORY_DOC ?= inventory/example/group_vars/all/proxmox.yml
inventory-doc: venv ## regenerate the settings' documentation in INVENTORY_DOC (the example's group_vars/all/proxmox.yml)
	$(PY) ansible/inventory_doc.py $(INVENTORY_DOC)

lint-ansible: venv ## ansible-lint (production profile) on both playbooks and every role
	cd ansible && PATH=$(abspath $(VENV))/bin:$$PATH ANSIBLE_CONFIG=ansible.cfg ansible-lint --profile production \
	  provision.yml training.yml roles

# `make lint` runs this too (a prerequisite added from this fragment).
lint: lint-ansible
