# Deployment stage: one training run. With INVENTORY=... the targets act on the provisioned containers
# (ansible/training.yml, role training_run); without it, on this machine's run in $(RUN_DIR) (the
# embedded default that `make train` runs in the foreground). Included by the top-level Makefile.
ON_CONTAINER := $(filter command line environment,$(origin INVENTORY))
TRAINING_PLAYBOOK = $(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY) ansible/training.yml $(ARGS)
# The run-control package (stdlib only) that the containers get, run here from the source tree.
RUNCTL = PYTHONPATH=ansible/roles/training_run/files $(PY) -m dflash_run
# FOLLOW=1: make train-logs keeps printing (locally) until the run ends.
FOLLOW ?=

.PHONY: deploy train-container train-status train-logs train-stop doctor-container rebuild-container

deploy: venv ## INVENTORY=...: trainer wheel + rendered run config into the containers, refused on drift; locally: preflight of $(RUN_DIR)
ifneq ($(ON_CONTAINER),)
	$(TRAINING_PLAYBOOK) -e training_run_action=deploy
else
	@echo "no INVENTORY: the local run needs no deploy (make train runs the embedded default); preflight of $(RUN_DIR):"
	$(RUNCTL) preflight --run-dir $(RUN_DIR) --cache-dir $(RUN_DIR)/compile-cache --gpus 0 --min-free-gb 1
endif

train-container: venv
	$(TRAINING_PLAYBOOK) -e training_run_action=train

train-status: venv ## state, last checkpoint and last log lines of the run (INVENTORY=...: in the containers)
ifneq ($(ON_CONTAINER),)
	$(TRAINING_PLAYBOOK) -e training_run_action=status
else
	$(RUNCTL) status --run-dir $(RUN_DIR)
endif

train-logs: venv ## the run's log (INVENTORY=...: from the containers; FOLLOW=1 follows a local one)
ifneq ($(ON_CONTAINER),)
	$(TRAINING_PLAYBOOK) -e training_run_action=logs
else
	$(RUNCTL) logs --run-dir $(RUN_DIR) $(if $(FOLLOW),--follow)
endif

train-stop: venv ## graceful stop: the checkpoint in progress is finished, make train resumes from it
ifneq ($(ON_CONTAINER),)
	$(TRAINING_PLAYBOOK) -e training_run_action=stop
else
	$(RUNCTL) stop --run-dir $(RUN_DIR)
endif

doctor-container: venv
	$(TRAINING_PLAYBOOK) -e training_run_action=doctor

rebuild-container: venv
	$(TRAINING_PLAYBOOK) -e training_run_action=rebuild

.PHONY: lint-deploy
lint-deploy: venv ## ansible-lint (production profile) on the run playbook (its role is linted with the others)
	cd ansible && PATH=$(abspath $(VENV))/bin:$$PATH ANSIBLE_CONFIG=ansible.cfg ansible-lint --profile production training.yml

lint: lint-deploy
