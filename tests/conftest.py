"""Shared pytest fixtures."""

import os
import re
from pathlib import Path

import pytest


def pytest_sessionstart(session):
    """datasets' log handler binds to sys.stderr when it is first configured: configure it at session start,
    not inside the first test that loads data, whose captured stream closes when that test ends (every later
    datasets warning would then print "--- Logging error ---" with a traceback)."""
    import datasets.utils.logging

    datasets.utils.logging.get_logger()

def pytest_collection_modifyitems(config, items):
    """A test marked gpu skips itself where torch sees no CUDA GPU, whether or not its file says so too: CI and a
    newcomer run plain `make test`, with no marker filter."""
    gpu_tests = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_tests:
        return
    try:
        import torch

        if torch.cuda.is_available():
            return
    except ImportError:  # a control-only environment without torch
        pass
    for item in gpu_tests:
        item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


# One intra-op thread for torch, here and in every process a test starts (torchrun workers, the CLIs): the
# tests' matrices are tiny, and two threads on a busy 2-core machine spin against each other. A linear layer
# of the tiny target took 20 ms instead of 0.5 ms that way; a tiny training run 60 s instead of 5 s. An
# OMP_NUM_THREADS set by the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# ansible.module_utils.basic (the provisioning tests import it) replaces sys.intern with an object, after
# which a first `import torch._dynamo` fails ("substitute_in_graph expects a function"). Import dynamo
# first, as every trainer process does, so the order pytest runs the files in does not matter.
try:
    import torch._dynamo

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
except ImportError:  # a control-only environment without torch
    pass


# --- Proxmox VE test host (tests/pve_testhost) --------------------------------------------------
@pytest.fixture(scope="session")
def pve_host(tmp_path_factory):
    """A PVE node stand-in: HTTPS API, real LXC containers, SSH with pct (see tests/pve_testhost/README.md)."""
    from tests.pve_testhost.fixture import pve_host_session

    yield from pve_host_session(tmp_path_factory.mktemp("pve-testhost"))


# --- Debian base (image/rootfs.py): under the image, and the test CTs whose init is systemd ---------
CACHE = Path(os.environ.get("DFLASH_TEST_CACHE", "/var/cache/dflash-tests"))


def apt_mirror() -> str:
    """The Debian mirror this machine's apt uses: the snapshot archive is not reachable from CI, so the
    tests take the same suite and packages from there; the snapshot date still clamps every mtime."""
    for f in sorted(Path("/etc/apt").glob("sources.list.d/*.sources")) + [Path("/etc/apt/sources.list")]:
        if f.is_file():
            m = re.search(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+/debian)/?\s", f.read_text(), re.MULTILINE)
            if m:
                return m.group(1)
    pytest.skip("no Debian mirror in /etc/apt: set DFLASH_DEBIAN_MIRROR")


@pytest.fixture(scope="session")
def image_cfg():
    from dflash_image import rootfs

    cfg = rootfs.load_config()
    cfg["mirror"] = os.environ.get("DFLASH_DEBIAN_MIRROR") or apt_mirror()
    return cfg


@pytest.fixture(scope="session")
def debian_rootfs(image_cfg) -> Path:
    """The Debian 13 base (mmdebstrap; systemd-sysv, python3), built once and cached in DFLASH_TEST_CACHE."""
    from dflash_image import rootfs

    if os.geteuid() != 0:
        pytest.skip("the Debian base needs root (mmdebstrap --mode=root)")
    return rootfs.build(CACHE, image_cfg)


# --- Trainer (dflash/) ---------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    """A tiny random Qwen3 target with the project's tokenizer, and chat JSONL from the bundled corpus."""
    import json

    import torch
    from dflash_trainer.embedded import TARGET_SHAPE, build_tokenizer, read_corpus
    from transformers import Qwen3Config, Qwen3ForCausalLM

    root = tmp_path_factory.mktemp("tiny-target")
    conversations = read_corpus()
    tokenizer = build_tokenizer([m["content"] for c in conversations for m in c])
    torch.manual_seed(0)
    shape = dict(TARGET_SHAPE, hidden_size=64, intermediate_size=128, head_dim=16)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tokenizer), **shape))
    model.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    for name, rows in (("train", conversations[:96]), ("eval", conversations[96:104])):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps({"messages": c}) + "\n" for c in rows)
    return {"target": str(root / "target"), "train": str(root / "train.jsonl"), "eval": str(root / "eval.jsonl")}


@pytest.fixture(autouse=True)
def _cuda_visible_devices_restored():
    """An in-process trainer run makes this process see one GPU (isolate_local_gpu sets CUDA_VISIBLE_DEVICES to
    its local rank's); a later test's torchrun workers must not inherit that list."""
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    yield
    if saved is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved


@pytest.fixture(autouse=True)
def _fresh_dynamo_for_gpu_tests(request):
    """GPU tests compile many shapes of the same layer function in one process: each starts from an empty
    dynamo cache, as a training process does, so one test's variants do not use up the next's recompile limit."""
    if request.node.get_closest_marker("gpu") is not None:
        import torch

        torch._dynamo.reset()
    yield
