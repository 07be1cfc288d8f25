# The development lock and its checks (image/devenv.py, image/drift.py); `make venv` is in the top Makefile.
UPGRADE    ?=
DRIFT_ARGS ?=
DEV_WHEELS := $(or $(strip $(WHEEL_CACHE)),wheels-dev)
# The scratch venv's interpreter stands in for {python}: test-fast's selection, in one process.
DRIFT_TEST  = {python} -m pytest -m "$(FAST_MARKERS)" -p no:cacheprovider $(PYTEST_ARGS)

.PHONY: dev-lock dev-wheels drift test-lowest build-check

# No venv prerequisite: a stale lock stops `make venv`, and this is its fix.
dev-lock: ## re-resolve uv.lock and requirements-zlab.txt (needs PyPI); UPGRADE=1: every package to its newest allowed
	$(PYTHON) image/devenv.py lock --venv $(VENV) --python $(PYTHON) $(if $(strip $(UPGRADE)),--upgrade)

dev-wheels: venv ## download the locked wheels this machine installs into WHEEL_CACHE (default wheels-dev/), hash-checked
	$(PY) -m dflash_image.devenv wheels --venv $(VENV) --python $(PYTHON) --dest $(DEV_WHEELS) \
	  --torch-build $(TORCH_BUILD) --torch-cpu-index $(TORCH_CPU_INDEX)

drift: venv ## test-fast against the newest allowed versions in a scratch venv: which package moved from uv.lock, what broke
	$(PY) -m dflash_image.drift --dev-extras --python $(PYTHON) --test-command '$(DRIFT_TEST)' $(DRIFT_ARGS)

test-lowest: venv ## test-fast against the lowest versions pyproject.toml claims (each direct dependency at its bound)
	$(PY) -m dflash_image.drift --resolution lowest-direct --dev-extras --python $(PYTHON) \
	  --test-command '$(DRIFT_TEST)' $(DRIFT_ARGS)

build-check: venv ## build the wheel with the locked setuptools; exit 1 on a deprecation warning in its output
	$(PY) -m dflash_image.devenv build-check
