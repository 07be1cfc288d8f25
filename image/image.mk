# image/: the frozen training environment. lock -> wheelhouse -> image -> Proxmox template; doctor; rebuild.
# Included by the top Makefile (which defines PY, VENV and the venv target).

ENV_DIR      ?= image/env
WHEELHOUSE   ?= wheelhouse
TRAINENV     ?= .trainenv
ENV_PYTHON   ?= python3.13
IMAGE_OUT    ?= build/image
TRAINER_WHL  ?= build/trainer-wheel
UV_BIN       ?= $(VENV)/bin/uv
DOCTOR_ARGS  ?=
IMAGE_ARGS   ?=

.PHONY: lock lock-check lock-export wheelhouse trainer-wheel rebuild doctor rootfs image

lock: venv ## re-resolve image/env (needs PyPI and download.pytorch.org/whl/cu128); exports pylock.toml + requirements.txt
	$(PY) -m dflash_image.lock refresh --project $(ENV_DIR)

lock-export: venv ## re-export pylock.toml and requirements.txt from the committed uv.lock (offline)
	$(PY) -m dflash_image.lock export --project $(ENV_DIR)

lock-check: venv ## lock is current, torch is +cu128 from the cu128 index, every wheel hashed
	$(PY) -m dflash_image.lock check --project $(ENV_DIR)

wheelhouse: venv ## download every locked wheel once (hash-checked) into $(WHEELHOUSE)/ for offline builds
	$(PY) -m dflash_image.wheelhouse --lock $(ENV_DIR)/pylock.toml --dest $(WHEELHOUSE)

trainer-wheel: venv ## build the trainer's wheel (dflash-trainer, with dflash_image) into $(TRAINER_WHL)/
	rm -rf $(TRAINER_WHL)
	SOURCE_DATE_EPOCH=$$(git log -1 --format=%ct 2>/dev/null || echo 1577836800) $(UV_BIN) build --wheel --out-dir $(TRAINER_WHL) .

# With INVENTORY=... these act on the containers instead (ansible/deploy.mk).
ifeq ($(ON_CONTAINER),)
rebuild: trainer-wheel ## recreate $(TRAINENV) from the lock + wheelhouse (offline, copied files), then run the doctor
	$(PY) -m dflash_image.rebuild --venv $(TRAINENV) --lock $(ENV_DIR) --wheelhouse $(WHEELHOUSE) \
	  --trainer-wheel $$(ls $(TRAINER_WHL)/dflash_trainer-*.whl) --python $(ENV_PYTHON) --uv $(UV_BIN)

doctor: ## compare $(TRAINENV) with the lock (inside the container: `dflash-doctor`); exit 1 on drift
	@test -x $(TRAINENV)/bin/dflash-doctor || { echo "no environment at $(TRAINENV): run make rebuild (or set TRAINENV=/path/to/venv)"; exit 2; }
	$(TRAINENV)/bin/dflash-doctor --lock $(ENV_DIR)/pylock.toml $(DOCTOR_ARGS)
else
rebuild: rebuild-container
doctor: doctor-container
endif

rootfs: venv ## the Debian base root filesystem (mmdebstrap, pinned snapshot; needs root)
	$(PY) -m dflash_image.rootfs --out $(IMAGE_OUT)

image: venv trainer-wheel ## docker image + Proxmox template (.tar.zst + .sha256) + OCI archive, into $(IMAGE_OUT)/
	$(PY) -m dflash_image.build --lock $(ENV_DIR) --wheelhouse $(WHEELHOUSE) \
	  --trainer-wheel $$(ls $(TRAINER_WHL)/dflash_trainer-*.whl) --out $(IMAGE_OUT) $(IMAGE_ARGS)
