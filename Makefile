# dflash-trainer: one Makefile, one fragment per stage (inventory -> ansible -> image -> dflash).
# `make train` and `make test` are the two set-up commands on a fresh machine.

SHELL      := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
PYTHON     ?= python3
VENV       ?= .venv
PY         := $(VENV)/bin/python
# The development venv is exactly uv.lock (image/devenv.py; `make dev-lock` refreshes it), plus z-lab's inference
# package (imported as `dflash`, pinned in requirements-zlab.txt without its own pins) to prove the checkpoints we
# write load in it. torch: TORCH_BUILD=lock is PyPI's build with the lock's hashes (CUDA on Linux), cpu the CPU
# build of the locked version, found where this machine's pip is configured to look, else in TORCH_CPU_INDEX (an
# index URL or a directory of wheels); auto: lock where an NVIDIA driver is loaded, else cpu where found, else
# lock. WHEEL_CACHE=DIR installs offline from DIR (`make dev-wheels` fills it).
TORCH_BUILD     ?= auto
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
WHEEL_CACHE     ?=
RUN_DIR    ?= runs/default
# make train: trainer arguments instead of the default --auto-resume (continue an unfinished RUN_DIR, report
# a finished one); --overwrite trains a finished RUN_DIR again.
TRAIN_ARGS ?=
PYTEST_ARGS ?=
# INVENTORY on the command line or in the environment: train, regenerate, eval and the deploy targets act on
# the containers of that inventory (ansible/deploy.mk); otherwise on this machine.
ON_CONTAINER := $(filter command line environment,$(origin INVENTORY))

.DEFAULT_GOAL := help
.PHONY: help venv test test-fast lint train eval bench clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_ -]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

# The stamp is written last and names the lock it was built from: a failed install leaves none. A TORCH_BUILD on
# the command line always reaches the script (a no-op when the venv already has that build).
$(VENV)/.installed: pyproject.toml uv.lock requirements-zlab.txt $(if $(filter command line,$(origin TORCH_BUILD)),FORCE)
	$(PYTHON) image/devenv.py install --venv $(VENV) --python $(PYTHON) --torch-build $(TORCH_BUILD) \
	  --torch-cpu-index $(TORCH_CPU_INDEX) $(if $(strip $(WHEEL_CACHE)),--wheels $(WHEEL_CACHE))

.PHONY: FORCE
FORCE:

venv: $(VENV)/.installed ## create the development venv (.venv) from uv.lock (TORCH_BUILD=lock|cpu|auto, WHEEL_CACHE=DIR offline)

test: venv ## run the test suite (GPU tests skip without a GPU)
	$(PY) -m pytest $(PYTEST_ARGS)

FAST_MARKERS := not slow and not docker and not lxc and not gpu
# One pytest worker per CPU this process may use (nproc: taskset and affinity); PYTEST_ARGS=-n0 for one process
# (--pdb needs it).
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)
test-fast: venv ## the tests not marked slow, docker, lxc or gpu, one worker per core: under 2 minutes on 2 cores
	$(PY) -m pytest -m "$(FAST_MARKERS)" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: venv ## ruff on the Python code (ansible/ too), ansible-lint on the playbooks and roles
	$(VENV)/bin/ruff check dflash image tests ansible

train: venv ## embedded default: tiny target + tiny drafter on this machine (CPU is fine); INVENTORY=...: in the containers
ifeq ($(ON_CONTAINER),)
	$(PY) -m dflash_trainer.train --config embedded --output-dir $(RUN_DIR) $(or $(strip $(TRAIN_ARGS)),--auto-resume)
else
	$(call JOB_PLAYBOOK,train,start)
endif

eval: venv ## evaluate a drafter: tau per prompt set, speedup, eval.png (EVAL_ARGS="--drafter DIR --target PATH --prompts FILE... --out DIR"; default: the run in RUN_DIR); INVENTORY=...: the container's run, detached
ifeq ($(ON_CONTAINER),)
	$(PY) -m dflash_trainer.eval $(or $(strip $(EVAL_ARGS)),--run $(RUN_DIR))
else
	$(call JOB_PLAYBOOK,eval,start)
endif

# make recipe: regenerate -> train -> eval as one detached chain in RECIPE_DIR (dflash_run/recipe.py). RECIPE_ARGS
# plans it (--config, --target, --data, --set, --args STAGE=ARGS, --nproc); empty: the plan already in RECIPE_DIR,
# else the embedded default. With INVENTORY: provision and deploy (both leave what is up to date alone), then the
# chain of the deployed jobs, supervised in the containers (ansible/deploy.mk). Run again, it continues where it
# stopped.
RECIPE_DIR  ?= runs/recipe
RECIPE_ARGS ?=
.PHONY: recipe recipe-status recipe-logs recipe-stop
recipe: venv ## regenerate -> train -> eval as one detached chain (RECIPE_ARGS="--config C --target DIR --data FILE..."; default: the embedded default); INVENTORY=...: provision, deploy, then the chain in the containers; again: continues where it stopped
ifeq ($(ON_CONTAINER),)
	$(RUNCTL) recipe --run-dir $(RECIPE_DIR) $(RECIPE_ARGS)
else
	$(ANSIBLE_PLAYBOOK) $(ARGS)
	$(TRAINING_PLAYBOOK) -e training_run_action=deploy
	$(TRAINING_PLAYBOOK) -e training_run_action=recipe -e training_run_job=recipe
endif

recipe-status: venv ## the chain's stages, the current one's last progress line, or the failed one's error and fix (INVENTORY=...: in the containers)
ifeq ($(ON_CONTAINER),)
	$(RUNCTL) status --job recipe --run-dir $(RECIPE_DIR)
else
	$(call JOB_PLAYBOOK,recipe,status)
endif

recipe-logs: venv ## the chain's log (FOLLOW=1 follows a local one); each stage's own: make recipe-status names its directory
ifeq ($(ON_CONTAINER),)
	$(RUNCTL) logs --job recipe --run-dir $(RECIPE_DIR) $(if $(FOLLOW),--follow)
else
	$(call JOB_PLAYBOOK,recipe,logs)
endif

recipe-stop: venv ## graceful stop of the chain (training stops after its checkpoint); make recipe continues it
ifeq ($(ON_CONTAINER),)
	$(RUNCTL) stop --job recipe --run-dir $(RECIPE_DIR)
else
	$(call JOB_PLAYBOOK,recipe,stop)
endif

bench: venv ## drafter-step benchmark (GPU); prints step time, tokens/s, MFU, peak memory
	$(PY) -m dflash_trainer.bench $(BENCH_ARGS)

bench-startup: venv ## time to first step of the real trainer (torchrun, offline drafter ranks), cold then warm compile cache (STARTUP_ARGS="--drafter-ranks 2")
	$(PY) -m dflash_trainer.bench.startup $(STARTUP_ARGS)

.PHONY: regenerate bench-regenerate bench-startup bench-quality
bench-quality: venv ## drafter quality against SpecForge and speculators on Gemma 3 270M, ShareGPT and HumanEval (GPU): tau per prompt set, per slot, a table and a figure (QUALITY_ARGS="--out DIR ...")
	$(PY) -m dflash_trainer.bench.quality $(QUALITY_ARGS)

regenerate: venv ## the target writes the training answers: REGEN_ARGS="--target DIR --data FILE --out DIR" (see README); INVENTORY=...: in the containers, detached
ifeq ($(ON_CONTAINER),)
	$(PY) -m dflash_trainer.regenerate $(REGEN_ARGS)
else
	$(call JOB_PLAYBOOK,regenerate,start)
endif

bench-regenerate: venv ## regeneration benchmark (GPU; Qwen3-8B shape): engine hf vs the old batched generate vs generate_batch
	$(PY) -m dflash_trainer.bench.regenerate $(REGEN_BENCH_ARGS)

# The run config's settings reference: every key of config.py with its type, default, range and comment
# (tests/test_docs.py checks it is current).
CONFIG_DOC ?= docs/settings.md
.PHONY: config-doc
config-doc: venv ## regenerate the run config's settings reference (docs/settings.md) from dflash_trainer/config.py
	$(PY) -m dflash_trainer.config_doc $(CONFIG_DOC)

clean: ## remove build outputs and runs (keeps the venv)
	rm -rf build dist *.egg-info runs .pytest_cache

-include image/devenv.mk
-include image/image.mk
-include ansible/ansible.mk
-include tests/testhost.mk
-include ansible/deploy.mk
