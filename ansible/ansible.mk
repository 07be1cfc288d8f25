# Provisioning stage: `make provision` creates and configures the GPU training containers of the
# inventory on Proxmox VE (ansible/provision.yml). Included by the top-level Makefile.
INVENTORY ?= inventory/example/hosts.yml
# Extra ansible-playbook arguments, e.g. ARGS="--limit trainer1 --ask-vault-pass".
ARGS ?=
ANSIBLE_ENV := ANSIBLE_CONFIG=ansible/ansible.cfg
ANSIBLE_PLAYBOOK := $(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY) ansible/provision.yml

.PHONY: provision provision-check provision-diff lint-ansible

provision: venv ## create/update the GPU containers of INVENTORY (ARGS="--check --diff" to preview)
	$(ANSIBLE_PLAYBOOK) $(ARGS)

provision-check: venv ## what `make provision` would change, changing nothing (--check --diff)
	$(ANSIBLE_PLAYBOOK) --check --diff $(ARGS)

provision-diff: venv ## provision and show every config change (--diff)
	$(ANSIBLE_PLAYBOOK) --diff $(ARGS)

lint-ansible: venv ## ansible-lint (production profile) on the playbook, roles and collection
	cd ansible && PATH=$(abspath $(VENV))/bin:$$PATH ANSIBLE_CONFIG=ansible.cfg ansible-lint --profile production provision.yml roles

# `make lint` runs this too (a prerequisite added from this fragment).
lint: lint-ansible
