"""End-to-end tests of `make provision`: real ansible-playbook runs of ansible/provision.yml against the
Proxmox VE test host (tests/pve_testhost: real API over TLS, real LXC containers, SSH with pct).

One module-scoped run order: fresh create -> second run no change -> check mode -> diff -> bad inputs.
Containers use vmids 91xx so they never collide with other tests on the same test host.
"""
from __future__ import annotations

import hashlib
import re
import shutil

import pytest

from tests.helpers.provision import DRIVER, Provision, api_writes, failure_text, recap

pytestmark = [pytest.mark.lxc, pytest.mark.slow]


# ---- fixtures --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prov(pve_host, tmp_path_factory):
    from tests.pve_testhost.templates import build_test_template

    work = tmp_path_factory.mktemp("provision")
    template = build_test_template()
    p = Provision(pve_host, work, template)
    yield p
    for vmid in (9101, 9102, 9103, 9104):
        if pve_host.container_exists(vmid):
            pve_host.ssh(f"pct stop {vmid}; pct destroy {vmid}")


@pytest.fixture(scope="module")
def created(prov):
    """Two containers created fresh (multi-container inventory): 9101 with dev[n], 9102 with raw lines."""
    inv = prov.inventory({
        "ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101", "proxmox_gpu_devices": [0]},
        "ct9102": {"proxmox_lxc_vmid": 9102, "proxmox_lxc_hostname": "ct9102", "proxmox_gpu_devices": "all",
                   "proxmox_gpu_method": "raw"},
    })
    prov.host.reset_calls()
    proc = prov.run(inv, "--diff")
    return inv, proc


# ---- the happy path ----------------------------------------------------------------------------------
def test_fresh_create_runs_clean(created, prov):
    _, proc = created
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    rc = recap(proc)
    assert rc["ct9101"]["failed"] == 0 and rc["ct9101"]["changed"] > 0
    assert prov.host.container_exists(9101) and prov.host.container_exists(9102)
    creates = [c for c in prov.host.calls() if c["method"] == "POST" and c["path"] == "/nodes/pve/lxc"]
    assert sorted(int(c["params"]["vmid"]) for c in creates) == [9101, 9102]
    # dev[n] went in at creation, through a ticket login (tokens can't)
    c9101 = next(c for c in creates if int(c["params"]["vmid"]) == 9101)
    assert c9101["auth"] == "ticket" and c9101["params"]["dev0"].startswith("/dev/nvidia0")
    assert not any(k.startswith("lxc") for c in creates for k in c["params"])


def test_template_uploaded_once(created, prov):
    uploads = [c for c in prov.host.calls() if c["path"].endswith("/upload")]
    assert len(uploads) <= 1  # the second container finds it there (throttled, checksum equal)
    res = prov.host.ssh(f"sha256sum /var/lib/vz/template/cache/{prov.template.name}")
    assert res.stdout.split()[0] == hashlib.sha256(prov.template.read_bytes()).hexdigest()


def test_config_matches_inventory(created, prov):
    conf = prov.host.pve_conf(9101).read_text()
    assert "hostname: ct9101" in conf and "memory: 256" in conf and "cores: 1" in conf
    assert re.search(r"^dev0: /dev/nvidia0", conf, re.MULTILINE)
    assert re.search(r"^dev\d+: /dev/nvidia-uvm,", conf, re.MULTILINE)
    assert "/dev/nvidia1" not in conf  # only GPU 0 was asked for
    raw = prov.host.pve_conf(9102).read_text()
    assert "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file" in raw
    uvm_major = re.search(r"^\s*(\d+) nvidia-uvm$", prov.host.ssh("cat /proc/devices").stdout, re.MULTILINE).group(1)
    assert f"lxc.cgroup2.devices.allow: c {uvm_major}:* rwm" in raw
    assert not re.search(r"^dev\d+:", raw, re.MULTILINE)


def test_gpu_devices_visible_inside(created, prov):
    for vmid, gpus in ((9101, ["/dev/nvidia0"]), (9102, ["/dev/nvidia0", "/dev/nvidia1"])):
        res = prov.host.exec_in_container(vmid, ["sh", "-c", "ls /dev/nvidia*"])
        assert res.returncode == 0, res.stderr
        seen = res.stdout.split()
        for dev in gpus + ["/dev/nvidiactl", "/dev/nvidia-uvm"]:
            assert dev in seen, (vmid, seen)
        smi = prov.host.exec_in_container(vmid, ["nvidia-smi", "-L"])
        assert smi.returncode == 0 and len(re.findall(r"^GPU \d+:", smi.stdout, re.MULTILINE)) == len(gpus), smi
    lib = prov.host.exec_in_container(9101, ["ls", "/usr/lib/x86_64-linux-gnu"])
    assert f"libnvidia-ml.so.{DRIVER}" in lib.stdout


def test_second_run_changes_nothing(created, prov):
    inv, _ = created
    prov.host.reset_calls()
    proc = prov.run(inv)
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    assert all(r["changed"] == 0 for r in recap(proc).values()), proc.stdout[-6000:]
    assert api_writes(prov.host) == []
    log = prov.host.exec_in_container(9101, ["cat", "/var/log/nvidia-installer.log"]).stdout
    assert log.count("installed userspace") == 1  # matched version: installer skipped


def test_stopped_container_is_re_provisioned(created, prov, tmp_path):
    """An existing container that is stopped: pct exec can't read its userspace before it starts, so the
    preflight checks that the installer is there before anything is written (check mode predicts it running);
    --check passes; with the installer there, the run starts it and skips the install (the userspace matches)."""
    host = {"ct9102": {"proxmox_lxc_vmid": 9102, "proxmox_lxc_hostname": "ct9102", "proxmox_gpu_devices": "all",
                       "proxmox_gpu_method": "raw"}}
    prov.host.ssh("pct stop 9102")
    try:
        prov.host.reset_calls()
        proc = prov.run(prov.inventory(host, nvidia_userspace_installer_dir=str(tmp_path)))  # an empty folder
        text = failure_text(proc)
        assert proc.returncode != 0, text[-4000:]
        assert f"{tmp_path}/NVIDIA-Linux-x86_64-{DRIVER}.run is missing on the controller" in text, text[-4000:]
        assert "it is stopped" in text and "Nothing was changed" in text
        assert "Traceback" not in text and api_writes(prov.host) == []
        assert "status: stopped" in prov.host.ssh("pct status 9102").stdout

        inv = prov.inventory(host)
        proc = prov.run(inv, "--check")
        assert proc.returncode == 0, failure_text(proc)[-6000:]
        assert recap(proc)["ct9102"]["changed"] >= 1 and api_writes(prov.host) == []

        proc = prov.run(inv)
        assert proc.returncode == 0, failure_text(proc)[-6000:]
        assert [c["path"] for c in api_writes(prov.host)] == ["/nodes/pve/lxc/9102/status/start"]
    finally:
        if "status: stopped" in prov.host.ssh("pct status 9102").stdout:  # a failed run: leave it as the others expect
            prov.host.ssh("pct start 9102")
    assert "status: running" in prov.host.ssh("pct status 9102").stdout
    log = prov.host.exec_in_container(9102, ["cat", "/var/log/nvidia-installer.log"]).stdout
    assert log.count("installed userspace") == 1  # matched version once started: installer skipped


def test_check_mode_reports_and_changes_nothing(created, prov):
    _, _ = created
    inv = prov.inventory({
        "ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101", "proxmox_gpu_devices": [0],
                   "proxmox_lxc_memory": 384, "proxmox_lxc_features": {"nesting": True, "keyctl": True}},
        "ct9103": {"proxmox_lxc_vmid": 9103, "proxmox_lxc_hostname": "ct9103", "proxmox_gpu_devices": [1]},
    })
    before = prov.host.pve_conf(9101).read_text()
    prov.host.reset_calls()
    proc = prov.run(inv, "--check", "--diff")
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    assert api_writes(prov.host) == []
    assert prov.host.pve_conf(9101).read_text() == before
    assert not prov.host.container_exists(9103)
    rc = recap(proc)
    assert rc["ct9101"]["changed"] >= 1 and rc["ct9103"]["changed"] >= 1
    out = proc.stdout
    assert "-memory: 256" in out and "+memory: 384" in out  # the diff of the config
    assert "would reboot container 9101" in out and "features" in out  # features need a restart


def test_diff_applies_update_and_controlled_reboot(created, prov):
    inv = prov.inventory({
        "ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101", "proxmox_gpu_devices": [0],
                   "proxmox_lxc_memory": 384, "proxmox_lxc_features": {"nesting": True, "keyctl": True}},
    })
    prov.host.reset_calls()
    proc = prov.run(inv, "--diff", "--limit", "ct9101")
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    out = proc.stdout
    assert "+memory: 384" in out and "+features: keyctl=1,nesting=1" in out
    puts = [c for c in prov.host.calls() if c["method"] == "PUT" and c["path"].endswith("/config")]
    assert len(puts) == 1 and puts[0]["params"]["memory"] == "384"
    assert any(c["path"].endswith("/status/reboot") for c in prov.host.calls())  # pending features applied
    conf = prov.host.pve_conf(9101).read_text()
    assert "memory: 384" in conf and "keyctl=1" in conf and "[pending]" not in conf
    again = prov.run(inv, "--limit", "ct9101")
    assert again.returncode == 0 and recap(again)["ct9101"]["changed"] == 0, again.stdout[-4000:]


def test_pending_changes_are_reported_when_reboot_is_off(created, prov):
    inv = prov.inventory({
        "ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101", "proxmox_gpu_devices": [0],
                   "proxmox_lxc_memory": 384, "proxmox_lxc_features": {"nesting": True},
                   "proxmox_lxc_reboot_for_pending": False},
    })
    prov.host.reset_calls()
    proc = prov.run(inv, "--limit", "ct9101")
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    assert "pending until its next reboot: features" in proc.stdout
    assert "has pending changes (features)" in proc.stdout + proc.stderr  # the module's warning
    assert not any(c["path"].endswith("/status/reboot") for c in prov.host.calls())
    # the next run with reboots allowed applies them (a controlled reboot) and then settles
    inv = prov.inventory({"ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101",
                                     "proxmox_gpu_devices": [0], "proxmox_lxc_memory": 384,
                                     "proxmox_lxc_features": {"nesting": True}}})
    prov.host.reset_calls()
    proc = prov.run(inv, "--limit", "ct9101")
    assert proc.returncode == 0, failure_text(proc)[-6000:]
    assert any(c["path"].endswith("/status/reboot") for c in prov.host.calls())
    assert "keyctl" not in prov.host.pve_conf(9101).read_text()


def test_template_uploaded_again_when_its_checksum_differs(created, prov, tmp_path):
    changed = tmp_path / prov.template.name  # same name, other content
    changed.write_bytes(prov.template.read_bytes() + b"\0" * 512)
    inv = prov.inventory({"ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101",
                                     "proxmox_gpu_devices": [0], "proxmox_lxc_memory": 384}},
                         proxmox_template_src=str(changed))
    prov.host.reset_calls()
    proc = prov.run(inv, "--limit", "ct9101", "--check")
    assert proc.returncode == 0 and not [c for c in prov.host.calls() if c["path"].endswith("/upload")]
    assert "changed: [ct9101]" in proc.stdout
    proc = prov.run(inv, "--limit", "ct9101")
    assert proc.returncode == 0, failure_text(proc)[-4000:]
    uploads = [c for c in prov.host.calls() if c["path"].endswith("/upload")]
    assert len(uploads) == 1 and uploads[0]["params"].get("checksum-algorithm") == "sha256"
    remote = prov.host.ssh(f"sha256sum /var/lib/vz/template/cache/{prov.template.name}").stdout.split()[0]
    assert remote == hashlib.sha256(changed.read_bytes()).hexdigest()
    # check mode on a node that lacks the template: would upload, would create, does neither
    renamed = tmp_path / "debian-12-dflash-check_1.0-1_amd64.tar.zst"
    shutil.copyfile(prov.template, renamed)
    prov.host.reset_calls()
    proc = prov.run(one(prov, proxmox_template_src=str(renamed)), "--check", "--diff")
    assert proc.returncode == 0, failure_text(proc)[-4000:]
    assert recap(proc)["ct9104"]["changed"] >= 2 and api_writes(prov.host) == []
    assert not prov.host.container_exists(9104)
    # put the original back for the other tests
    proc = prov.run(prov.inventory({"ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101",
                                               "proxmox_gpu_devices": [0], "proxmox_lxc_memory": 384}}),
                    "--limit", "ct9101")
    assert proc.returncode == 0


def test_training_venv_missing_gets_a_clear_message(created, prov, tmp_path):
    host = {"ct9101": {"proxmox_lxc_vmid": 9101, "proxmox_lxc_hostname": "ct9101", "proxmox_gpu_devices": [0],
                       "proxmox_lxc_memory": 384}}
    # no venv in the container and no rebuild inputs: use the frozen template or give the inputs
    proc = prov.run(prov.inventory(host, training_venv_enabled=True), "--limit", "ct9101")
    text = failure_text(proc)
    assert proc.returncode != 0
    assert "Container 9101 has no training venv at /opt/venv" in text, text[-3000:]
    assert "training_venv_wheelhouse" in text
    # with rebuild inputs, a container without python3 is refused before anything is copied in
    inputs = {}
    for name in ("lock", "wheelhouse"):
        (tmp_path / name).mkdir()
        inputs[f"training_venv_{name}" + ("_dir" if name == "lock" else "")] = str(tmp_path / name)
    for name in ("pylock.toml", "requirements.txt"):  # the preflight looks for them (the content is not read)
        (tmp_path / "lock" / name).write_text("")
    (tmp_path / "dflash_trainer-0.1.0-py3-none-any.whl").write_bytes(b"")
    (tmp_path / "uv").write_bytes(b"")
    proc = prov.run(prov.inventory(host, training_venv_enabled=True,
                                   training_venv_trainer_wheel=str(tmp_path / "dflash_trainer-0.1.0-py3-none-any.whl"),
                                   training_venv_uv=str(tmp_path / "uv"), **inputs), "--limit", "ct9101")
    text = failure_text(proc)
    assert proc.returncode != 0
    assert "Container 9101 has no python3" in text, text[-3000:]
    assert prov.host.exec_in_container(9101, ["ls", "/var/tmp"]).stdout.strip() == ""


# ---- bad input: a clear message, nothing changed, no secret printed ----------------------------------
def one(prov, vmid=9104, hostname="ct9104", **over):
    host_vars = {"proxmox_lxc_vmid": vmid, "proxmox_lxc_hostname": hostname, "proxmox_gpu_devices": [0]}
    host_vars.update({k: v for k, v in over.items() if k.startswith(("proxmox_lxc_", "proxmox_gpu"))})
    group = {k: v for k, v in over.items() if k not in host_vars}
    return prov.inventory({hostname: host_vars}, **group)


def assert_refused(prov, proc, *needles, vmid=9104):
    text = failure_text(proc)
    assert proc.returncode != 0, text[-4000:]
    for needle in needles:
        assert needle in text, (needle, text[-4000:])
    assert "Traceback" not in text
    assert not prov.host.container_exists(vmid)
    assert not [c for c in api_writes(prov.host) if c["path"] in ("/nodes/pve/lxc",) or f"/lxc/{vmid}" in c["path"]]


@pytest.mark.parametrize("vmid", ["42", "abc"])
def test_invalid_vmid(created, prov, vmid):
    prov.host.reset_calls()
    proc = prov.run(one(prov, vmid=vmid))
    assert_refused(prov, proc, f"vmid {vmid!r}", "proxmox_lxc_vmid")


def test_unknown_node(created, prov):
    prov.host.reset_calls()
    proc = prov.run(one(prov, proxmox_node="nosuchnode"))
    assert_refused(prov, proc, "'nosuchnode'", "proxmox_node")


def test_unknown_storage(created, prov):
    prov.host.reset_calls()
    proc = prov.run(one(prov, proxmox_lxc_storage="nosuchstore"))
    assert_refused(prov, proc, "storage 'nosuchstore' does not exist")


def test_missing_template(created, prov):
    prov.host.reset_calls()
    proc = prov.run(one(prov, proxmox_template_src="", proxmox_lxc_template="local:vztmpl/missing.tar.zst"))
    assert_refused(prov, proc, "template local:vztmpl/missing.tar.zst is missing")


def test_wrong_password(created, prov):
    prov.host.reset_calls()
    proc = prov.run(one(prov), env_secrets={"PROXMOX_PASSWORD": "not-the-password"})
    assert_refused(prov, proc, "login to https://127.0.0.1", "wrong user or password")


def test_wrong_token(created, prov):
    prov.host.reset_calls()
    proc = prov.run(one(prov, proxmox_gpu_method="raw"), token=True, password=False,
                    env_secrets={"PROXMOX_TOKEN_SECRET": "00000000-dead-beef-0000-000000000000"})
    assert_refused(prov, proc, "API token root@pam!ci was rejected")


def test_tls_verification_failure(created, prov, tmp_path):
    import trustme
    other_ca = tmp_path / "other-ca.pem"
    trustme.CA().cert_pem.write_to_path(str(other_ca))
    prov.host.reset_calls()
    proc = prov.run(one(prov, proxmox_api_ca_path=str(other_ca)))
    assert_refused(prov, proc, "TLS verification of https://127.0.0.1", "proxmox_api_ca_path")


def test_token_with_dev_method_says_so_plainly(created, prov):
    prov.host.reset_calls()
    proc = prov.run(one(prov), token=True, password=False)
    assert_refused(prov, proc, "can only be set by root@pam", "an API token is configured",
                   "proxmox_gpu_method: raw")


def test_token_with_raw_method_works_for_an_existing_container(created, prov):
    inv = prov.inventory({"ct9102": {"proxmox_lxc_vmid": 9102, "proxmox_lxc_hostname": "ct9102",
                                     "proxmox_gpu_devices": "all", "proxmox_gpu_method": "raw"}})
    proc = prov.run(inv, token=True, password=False)
    assert proc.returncode == 0, failure_text(proc)[-4000:]
    assert recap(proc)["ct9102"]["changed"] == 0


def test_vmid_of_another_hostname_is_refused(created, prov):
    before = prov.host.pve_conf(9101).read_text()
    prov.host.reset_calls()
    proc = prov.run(one(prov, vmid=9101, hostname="intruder"))
    text = failure_text(proc)
    assert proc.returncode != 0
    assert "vmid 9101 is already used by container 'ct9101'" in text
    assert prov.host.pve_conf(9101).read_text() == before
    assert api_writes(prov.host) == []


def test_failed_create_task_shows_its_log_and_leaves_nothing(created, prov):
    prov.host.reset_calls()
    prov.host.set_task_failure("vzcreate", "unable to create CT 9104 - disk quota exceeded (test)")
    proc = prov.run(one(prov))
    text = failure_text(proc)
    assert proc.returncode != 0
    assert "creating container 9104 failed on node pve" in text
    assert "disk quota exceeded (test)" in text and "Last lines of the task log" in text
    assert not prov.host.container_exists(9104)
