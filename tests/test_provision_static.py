"""Static checks of the provisioning stage: ansible-lint (production profile), module documentation, the
example inventory resolving per-node settings for several nodes and containers, and every file and make
target that the example, the roles and the messages name existing."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible" / "ansible.cfg"), ANSIBLE_NOCOLOR="1",
           PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
MODULES = ["pve_lxc", "pve_template", "pve_host_facts", "pve_lxc_raw", "pve_pct_exec", "pve_lxc_power"]
EXAMPLE = REPO / "inventory" / "example"
COLLECTIONS = REPO / "ansible" / "collections"
if str(COLLECTIONS) not in sys.path:
    sys.path.insert(0, str(COLLECTIONS))


@pytest.mark.slow  # make lint runs it too
def test_ansible_lint_production_profile_is_clean():
    proc = subprocess.run([str(BIN / "ansible-lint"), "--profile", "production", "provision.yml", "training.yml",
                           "roles"], cwd=REPO / "ansible", env=ENV, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr


def test_every_module_documents_its_options():
    proc = subprocess.run([str(BIN / "ansible-doc"), "--json", *[f"dflash.proxmox.{m}" for m in MODULES],
                           "dflash.proxmox.inventory_secrets"], env=ENV, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    docs = json.loads(proc.stdout)
    for m in MODULES:
        doc = docs[f"dflash.proxmox.{m}"]["doc"]
        assert "api_host" in doc["options"] and "ssh_host" in doc["options"]  # the shared fragment
    assert "devices" in docs["dflash.proxmox.pve_lxc"]["doc"]["options"]
    assert "variables" in docs["dflash.proxmox.inventory_secrets"]["doc"]["options"]


def test_example_inventory_resolves_each_node_and_container():
    def host(name):
        proc = subprocess.run([str(BIN / "ansible-inventory"), "-i", str(EXAMPLE / "hosts.yml"), "--host", name],
                              env=dict(ENV, PROXMOX_PASSWORD=""), capture_output=True, text=True, timeout=120,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    t1, t2 = host("trainer1"), host("trainer2")
    assert (t1["proxmox_node"], t1["proxmox_lxc_vmid"], t1["proxmox_gpu_devices"]) == ("pve1", 200, list(range(8)))
    assert (t2["proxmox_node"], t2["proxmox_lxc_vmid"], t2["proxmox_gpu_devices"]) == ("pve2", 300, "all")
    assert (t2["proxmox_api_host"], t2["proxmox_gpu_method"]) == ("pve2.example.org", "raw")
    assert (t1["proxmox_lxc_storage"], t2["proxmox_lxc_storage"]) == ("local-lvm", "local-zfs")  # per node
    # the GPU split the docs give for an 8-GPU container (docs/gpu-split.md)
    assert (t1["training_run_target_gpus"], t1["training_run_drafter_gpus"]) == (3, 5)
    assert "proxmox_gpu_method" not in t1  # the role's default, dev
    # no secret in the inventory at all: the proxmox role's defaults read the vault or the environment
    assert not [k for k in t1 if re.search(r"password|secret", k)]


def make_variable(name: str) -> str:
    """A variable as the Makefile (and its fragments) define it."""
    proc = subprocess.run(["make", "-s", "--no-print-directory", "--eval", f"print-variable: ; @echo $({name})",
                           "print-variable"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_example_template_is_the_file_make_image_writes(tmp_path):
    """proxmox_template_src names what `make image` writes (image/build.py names it with template_name)."""
    from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import resolve_src
    from dflash_image import rootfs, template

    src = yaml.safe_load((EXAMPLE / "group_vars" / "all" / "proxmox.yml").read_text())["proxmox_template_src"]
    assert src.startswith("{{ inventory_dir }}/") and src.count("{{") == 1, src
    pattern = Path(src.replace("{{ inventory_dir }}", str(EXAMPLE)))
    assert pattern.parent.resolve() == (REPO / make_variable("IMAGE_OUT")).resolve()
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    name = template.template_name(rootfs.load_config()["release"], version, "ab" * 32)
    # what one `make image` leaves in its output folder, and an older build beside it
    out = tmp_path / "inventory" / "site" / pattern.parent.relative_to(EXAMPLE)
    out.mkdir(parents=True)
    older = template.template_name(rootfs.load_config()["release"], "0.0.9", "cd" * 32)
    for file, mtime in ((older, 1_000_000), (name, 2_000_000), (name + ".sha256", 2_000_000),
                        (name.replace(".tar.zst", ".json"), 2_000_000), (name.replace(".tar.zst", ".oci.tar"), 2_000_000)):
        (out / file).write_bytes(b"x")
        os.utime(out / file, (mtime, mtime))
    site_src = src.replace("{{ inventory_dir }}", str(tmp_path / "inventory" / "site"))
    assert resolve_src(site_src) == (str(out / name), [str(out / older)])  # the newest template, nothing else


def make_targets() -> set[str]:
    targets = set()
    for mk in [REPO / "Makefile", *REPO.glob("*/*.mk")]:
        for names in re.findall(r"^([a-zA-Z][a-zA-Z0-9_ -]*?)\s*:(?!=)", mk.read_text(), re.MULTILINE):
            targets |= set(names.split())  # `train-status regenerate-status eval-status: %-status: venv`
    return targets


def test_every_make_target_the_docs_and_messages_name_exists():
    english = {"sure", "absolute", "targets"}  # "make sure", not a target
    named = {}
    files = [REPO / "README.md", *EXAMPLE.rglob("*"), *(REPO / "inventory").glob("*.md"),
             *[p for p in (REPO / "ansible").rglob("*") if p.suffix in (".yml", ".py", ".j2", ".md", ".mk")]]
    for path in files:
        if path.is_file():
            for target in re.findall(r"\bmake ([a-z][a-z0-9]*(?:-[a-z0-9]+)*)", path.read_text()):
                named.setdefault(target, path.relative_to(REPO))
    missing = {t: str(p) for t, p in named.items() if t not in make_targets() | english}
    assert not missing, f"make targets named but not defined: {missing}"
    assert {"image", "provision", "deploy", "inventory-doc"} <= set(named)


def test_every_folder_the_role_defaults_name_exists():
    """Role defaults that point into this repository ({{ playbook_dir }}/..) name folders that are there or that
    a make target writes (build/)."""
    for defaults in (REPO / "ansible" / "roles").glob("*/defaults/main.yml"):
        for name, value in (yaml.safe_load(defaults.read_text()) or {}).items():
            if isinstance(value, str) and value.startswith("{{ playbook_dir }}/../"):
                rel = value.removeprefix("{{ playbook_dir }}/../").split("{{")[0].rstrip("/")
                assert (REPO / rel).exists() or rel.split("/")[0] == "build", (defaults, name, value)
