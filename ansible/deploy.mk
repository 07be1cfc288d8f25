# Deployment stage: the jobs of one run (train, regenerate, eval). With INVENTORY=... the targets act on the
# provisioned containers (ansible/training.yml, role training_run); without it, on this machine's run in
# $(RUN_DIR) (the embedded default that `make train` runs in the foreground). Included by the top-level Makefile.
TRAINING_PLAYBOOK = $(ANSIBLE_ENV) $(VENV)/bin/ansible-playbook -i $(INVENTORY) ansible/training.yml $(ARGS)
# $(call JOB_PLAYBOOK,job,action): the playbook acting on one job (train, regenerate or eval) in the containers.
JOB_PLAYBOOK = $(TRAINING_PLAYBOOK) -e training_run_job=$(1) -e training_run_action=$(2)
# The run controller (the trainer wheel's dflash-run; the containers run the same from their venv).
RUNCTL = $(VENV)/bin/dflash-run
# FOLLOW=1: make train-logs keeps printing (locally) until the run ends.
FOLLOW ?=

.PHONY: deploy doctor-container rebuild-container train-status train-logs train-stop \
	regenerate-status regenerate-logs regenerate-stop eval-status eval-logs eval-stop

deploy: venv ## INVENTORY=...: trainer wheel + rendered run config + each job's launch into the containers, refused on drift; locally: preflight of $(RUN_DIR)
ifneq ($(ON_CONTAINER),)
	$(TRAINING_PLAYBOOK) -e training_run_action=deploy
else
	@echo "no INVENTORY: the local run needs no deploy (make train runs the embedded default); preflight of $(RUN_DIR):"
	$(RUNCTL) preflight --run-dir $(RUN_DIR) --cache-dir $(RUN_DIR)/compile-cache --gpus 0 --min-free-gb 1
endif

# Without INVENTORY only the training has a supervised run here ($(RUN_DIR)): `make regenerate` and
# `make eval` run in the foreground and report on their terminal.
regenerate-status regenerate-logs regenerate-stop eval-status eval-logs eval-stop: containers-only
.PHONY: containers-only
containers-only:
ifeq ($(ON_CONTAINER),)
	@echo "make $(MAKECMDGOALS) acts on the containers: give INVENTORY=... (without it, make regenerate and make eval" \
	  "run in the foreground and report on their terminal)" >&2
	@exit 2
endif

train-status regenerate-status eval-status: %-status: venv ## a job's state, progress and last log lines (INVENTORY=...: in the containers)
ifneq ($(ON_CONTAINER),)
	$(call JOB_PLAYBOOK,$*,status)
else
	$(RUNCTL) status --run-dir $(RUN_DIR)
endif

train-logs regenerate-logs eval-logs: %-logs: venv ## a job's log (INVENTORY=...: from the containers; FOLLOW=1 follows a local one)
ifneq ($(ON_CONTAINER),)
	$(call JOB_PLAYBOOK,$*,logs)
else
	$(RUNCTL) logs --run-dir $(RUN_DIR) $(if $(FOLLOW),--follow)
endif

train-stop regenerate-stop eval-stop: %-stop: venv ## graceful stop: the checkpoint (shard) in progress is finished, make train (regenerate) resumes
ifneq ($(ON_CONTAINER),)
	$(call JOB_PLAYBOOK,$*,stop)
else
	$(RUNCTL) stop --run-dir $(RUN_DIR)
endif

doctor-container: venv
	$(TRAINING_PLAYBOOK) -e training_run_action=doctor

rebuild-container: venv
	$(TRAINING_PLAYBOOK) -e training_run_action=rebuild
