"""Integration tests of the PVE test host itself: real HTTPS, real LXC containers, real sshd and pct."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from proxmoxer import ProxmoxAPI
from proxmoxer.core import ResourceException

from tests.pve_testhost.fixture import REPO_ROOT, missing_prerequisites
from tests.pve_testhost.templates import PYTHON_TEMPLATE_NAME, TEMPLATE_NAME, build_test_template

pytestmark = pytest.mark.lxc


def token_api(h):
    return ProxmoxAPI(h.api_host, port=h.api_port, user="root@pam", token_name="ci", token_value=h.token_secret,
                      verify_ssl=h.ca_cert)


def root_api(h):
    return ProxmoxAPI(h.api_host, port=h.api_port, user="root@pam", password=h.root_password, verify_ssl=h.ca_cert)


def wait_task(api, upid, timeout=60):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        st = api.nodes("pve").tasks(upid).status.get()
        seen.append(st["status"])
        if st["status"] == "stopped":
            return st, seen
        time.sleep(0.05)
    raise AssertionError(f"task {upid} still running after {timeout} s")


@pytest.fixture(scope="module")
def template(pve_host):
    """The tiny template, uploaded once through the API (as provisioning does)."""
    api = token_api(pve_host)
    path = build_test_template(REPO_ROOT / "build" / "testhost")
    with open(path, "rb") as fh:
        upid = api.nodes("pve").storage("local").upload.post(content="vztmpl", filename=fh)
    st, _ = wait_task(api, upid)
    assert st["exitstatus"] == "OK", st
    return f"local:vztmpl/{TEMPLATE_NAME}"


def create(api, vmid, template, **params):
    upid = api.nodes("pve").lxc.post(vmid=vmid, ostemplate=template, **params)
    st, _ = wait_task(api, upid)
    assert st["exitstatus"] == "OK", api.nodes("pve").tasks(upid).log.get()
    return upid


def destroy(api, vmid):
    if api.nodes("pve").lxc(vmid).status.current.get()["status"] == "running":
        wait_task(api, api.nodes("pve").lxc(vmid).status.stop.post())
    st, _ = wait_task(api, api.nodes("pve").lxc(vmid).delete())
    assert st["exitstatus"] == "OK"


def test_bad_parameters_get_pves_400_shape(pve_host):
    r = requests.post(f"{pve_host.api_url}/nodes/pve/lxc", verify=pve_host.ca_cert,
                      headers={"Authorization": f"PVEAPIToken={pve_host.token_id}={pve_host.token_secret}"},
                      data={"vmid": "12", "ostemplate": "local:vztmpl/x.tar.zst", "cores": "many",
                            "lxc.cgroup2.devices.allow": "c 195:* rwm"})
    assert r.status_code == 400
    assert r.reason == "Parameter verification failed."
    assert r.json() == {"data": None, "errors": {
        "vmid": "value must have a minimum value of 100",
        "cores": "type check ('integer') failed - got 'many'",
        "lxc.cgroup2.devices.allow": "property is not defined in schema and the schema does not allow "
                                     "additional properties"}}
    with pytest.raises(ResourceException) as exc:  # and proxmoxer sees them as PVE's
        token_api(pve_host).nodes("pve").lxc(100).config.put(**{"lxc.idmap": "u 0 100000 65536"})
    assert exc.value.status_code == 400 and "lxc.idmap" in exc.value.errors


def test_auth_modes_and_refusals(pve_host):
    url = f"{pve_host.api_url}/version"
    assert requests.get(url, verify=pve_host.ca_cert).status_code == 401
    bad = {"Authorization": f"PVEAPIToken={pve_host.token_id}=wrong"}
    assert requests.get(url, verify=pve_host.ca_cert, headers=bad).status_code == 401
    login = requests.post(f"{pve_host.api_url}/access/ticket", verify=pve_host.ca_cert,
                          data={"username": "root@pam", "password": pve_host.root_password}).json()["data"]
    cookies = {"PVEAuthCookie": login["ticket"]}
    assert requests.get(url, verify=pve_host.ca_cert, cookies=cookies).json()["data"]["release"] == "9.1"
    no_csrf = requests.put(f"{pve_host.api_url}/nodes/pve/lxc/100/config", verify=pve_host.ca_cert,
                           cookies=cookies, data={"memory": "1024"})
    assert (no_csrf.status_code, no_csrf.reason) == (401, "Permission denied - invalid csrf token")
    wrong = requests.post(f"{pve_host.api_url}/access/ticket", verify=pve_host.ca_cert,
                          data={"username": "root@pam", "password": "nope"})
    assert wrong.status_code == 401 and wrong.json() == {"data": None}
    assert root_api(pve_host).version.get()["version"].startswith("9.")


def test_token_cannot_set_dev0_but_root_can(pve_host, template):
    tok, root = token_api(pve_host), root_api(pve_host)
    with pytest.raises(ResourceException) as exc:
        tok.nodes("pve").lxc.post(vmid=150, ostemplate=template, dev0="/dev/nvidia0,mode=0666")
    assert exc.value.status_code == 403
    assert "configuring device passthrough is only allowed for root@pam" in str(exc.value)
    assert not pve_host.container_exists(150)
    create(tok, 150, template)
    with pytest.raises(ResourceException, match="only allowed for root@pam"):
        tok.nodes("pve").lxc(150).config.put(dev0="/dev/nvidia0")
    with pytest.raises(ResourceException, match=r"feature flags \(except nesting\)"):
        tok.nodes("pve").lxc(150).config.put(features="nesting=1,keyctl=1")
    tok.nodes("pve").lxc(150).config.put(features="nesting=1")
    root.nodes("pve").lxc(150).config.put(dev0="/dev/nvidia0,mode=0666")
    assert root.nodes("pve").lxc(150).config.get()["dev0"] == "/dev/nvidia0,mode=0666"
    with pytest.raises(ResourceException, match="Device /dev/nvidia9 does not exist"):
        root.nodes("pve").lxc(150).config.put(dev1="/dev/nvidia9")
    destroy(tok, 150)
    assert not pve_host.container_exists(150)


def test_failing_tasks_report_their_error(pve_host, template):
    api = root_api(pve_host)
    pve_host.set_task_failure("vzcreate", "unable to create CT 160 - no space left on device")
    upid = api.nodes("pve").lxc.post(vmid=160, ostemplate=template)
    st, _seen = wait_task(api, upid)
    assert st["exitstatus"] == "unable to create CT 160 - no space left on device"
    assert api.nodes("pve").tasks(upid).log.get()[-1] == {
        "n": len(api.nodes("pve").tasks(upid).log.get()),
        "t": "TASK ERROR: unable to create CT 160 - no space left on device"}
    assert not pve_host.container_exists(160)
    # A real failure: a bridge the node does not have makes the start task fail, as on PVE.
    create(api, 160, template, net0="name=eth0,bridge=vmbr9")
    st, _ = wait_task(api, api.nodes("pve").lxc(160).status.start.post())
    assert st["exitstatus"] == "bridge 'vmbr9' does not exist"
    assert api.nodes("pve").lxc(160).status.current.get()["status"] == "stopped"
    # Raw cgroup v1 keys are accepted with a warning and no effect: WARNINGS: 1.
    api.nodes("pve").lxc(160).config.put(net0="name=eth0,bridge=vmbr0")
    with open(pve_host.pve_conf(160), "a") as fh:
        fh.write("lxc.cgroup.devices.allow: c 195:* rwm\n")
    upid = api.nodes("pve").lxc(160).status.start.post()
    st, _ = wait_task(api, upid)
    assert st["exitstatus"] == "WARNINGS: 1"
    assert api.nodes("pve").tasks(upid).log.get()[-1]["t"] == "TASK WARNINGS: 1"
    destroy(api, 160)


def test_containers_really_run_with_gpu_devices(pve_host, template):
    api = root_api(pve_host)
    vmid = int(api.cluster.nextid.get())
    upid = create(api, vmid, template, hostname="trainer", memory=1024, cores=2, features="nesting=1",
                  net0="name=eth0,bridge=vmbr0,ip=dhcp", dev0="/dev/nvidia0,mode=0666",
                  dev1="/dev/nvidiactl,gid=44,mode=0660")
    assert upid.startswith("UPID:pve:") and f":vzcreate:{vmid}:root@pam:" in upid
    conf = api.nodes("pve").lxc(vmid).config.get()
    assert conf["unprivileged"] == 1 and conf["memory"] == 1024 and conf["ostype"] == "debian"
    assert conf["rootfs"] == f"local:{vmid}/vm-{vmid}-disk-0.raw,size=4G"
    assert conf["net0"].startswith("name=eth0,bridge=vmbr0,hwaddr=BC:24:11:")
    assert pve_host.pve_conf(vmid).read_text().splitlines()[0] == "arch: amd64"
    st, seen = wait_task(api, api.nodes("pve").lxc(vmid).status.start.post())
    assert st["exitstatus"] == "OK" and seen[-1] == "stopped"
    assert api.nodes("pve").lxc(vmid).status.current.get()["status"] == "running"
    res = pve_host.exec_in_container(vmid, ["/bin/sh", "-c", ("hostname; ls -ln /dev/nvidia0 /dev/nvidiactl; "
                                            "cat /proc/1/cmdline | tr '\\0' ' '; echo; cat /proc/driver/nvidia/version")])
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "trainer"
    assert lines[1].split()[0] == "crw-rw-rw-" and "195," in lines[1] and lines[1].split()[5] == "0"
    assert lines[2].split()[0] == "crw-rw----" and lines[2].split()[3] == "44" and lines[2].split()[5] == "255"
    assert lines[3].strip() == "/bin/sh /sbin/init"
    assert lines[4].startswith("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05")
    # Changes that cannot be hot-plugged wait in pending until the next start.
    api.nodes("pve").lxc(vmid).config.put(dev2="/dev/nvidia1,mode=0666", memory=2048)
    pending = {p["key"]: p for p in api.nodes("pve").lxc(vmid).pending.get()}
    assert pending["dev2"]["pending"] == "/dev/nvidia1,mode=0666" and "value" not in pending["dev2"]
    assert api.nodes("pve").lxc(vmid).config.get(current=1)["memory"] == 2048
    st, _ = wait_task(api, api.nodes("pve").lxc(vmid).status.reboot.post())
    assert st["exitstatus"] == "OK"
    assert pve_host.exec_in_container(vmid, ["ls", "/dev/nvidia1"]).returncode == 0
    st, _ = wait_task(api, api.nodes("pve").lxc(vmid).status.shutdown.post(timeout=10))
    assert st["exitstatus"] == "OK"
    assert api.nodes("pve").lxc(vmid).status.current.get()["status"] == "stopped"
    assert vmid in [r["vmid"] for r in api.cluster.resources.get(type="vm")]
    destroy(api, vmid)
    assert not pve_host.container_exists(vmid)


def test_pct_and_the_node_shell_over_ssh(pve_host, template, tmp_path):
    api = root_api(pve_host)
    create(api, 170, template, hostname="sshct")
    node_view = pve_host.ssh("cat /proc/driver/nvidia/version; ls -l /dev/nvidia0 /dev/nvidiactl; "
                             "grep -E 'nvidia-(uvm|caps)' /proc/devices; nvidia-smi -L; "
                             f"sha256sum /var/lib/vz/template/cache/{TEMPLATE_NAME}; pct start 170; pct status 170")
    assert node_view.returncode == 0, node_view.stderr
    out = node_view.stdout.splitlines()
    assert out[0].startswith("NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.95.05")
    assert out[2].startswith("crw-rw-rw- 1 root root 195,   0") and out[3].startswith("crw-rw-rw- 1 root root 195, 255")
    uvm_major = int(next(ln for ln in out if ln.endswith("nvidia-uvm")).split()[0])
    assert uvm_major != 195 and any(ln.endswith("nvidia-caps") for ln in out)
    assert out[6] == "GPU 0: NVIDIA H200 (UUID: GPU-7e570000-0000-4000-8000-000000000000)" and len(
        [ln for ln in out if ln.startswith("GPU ")]) == len(pve_host.gpus)
    assert out[-2].split()[0] == __import__("hashlib").sha256(
        build_test_template(REPO_ROOT / "build" / "testhost").read_bytes()).hexdigest()
    assert out[-1] == "status: running"
    # Raw lxc.* lines written into the host's config take effect at the next start.
    edit = pve_host.ssh("echo 'lxc.cgroup2.devices.allow: c 195:* rwm' >> /etc/pve/lxc/170.conf && "
                        "echo 'lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file' "
                        ">> /etc/pve/lxc/170.conf && pct reboot 170 && pct exec 170 -- ls -l /dev/nvidia-uvm")
    assert edit.returncode == 0, edit.stderr
    assert f"{uvm_major},   0" in edit.stdout
    assert api.nodes("pve").lxc(170).config.get()["lxc"] == [
        ["lxc.cgroup2.devices.allow", "c 195:* rwm"],
        ["lxc.mount.entry", "/dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"]]
    # push, pull, set, config
    src = tmp_path / "hello.txt"
    src.write_text("hello from the host\n")
    io = pve_host.ssh(f"pct push 170 {src} /root/hello.txt --perms 0600 && pct exec 170 -- ls -l /root/hello.txt"
                      f" && pct pull 170 /etc/hostname {tmp_path}/pulled && pct set 170 -cores 3 -dev0 /dev/nvidia1"
                      " && pct config 170")
    assert io.returncode == 0, io.stderr
    assert io.stdout.splitlines()[0].startswith("-rw-------")
    assert (tmp_path / "pulled").read_text() == "sshct\n"
    assert "cores: 3" in io.stdout and "dev0: /dev/nvidia1" in io.stdout
    refused = pve_host.ssh("pct set 170 -lxc.idmap 'u 0 100000 65536'")
    assert refused.returncode != 0 and "property is not defined in schema" in refused.stderr
    assert pve_host.ssh("pct exec 170 -- false").returncode == 1
    assert pve_host.ssh("pct stop 170 && pct status 170").stdout.strip() == "status: stopped"
    destroy(api, 170)


def test_python_template_runs_python_in_the_ct(pve_host):
    api = token_api(pve_host)
    path = build_test_template(REPO_ROOT / "build" / "testhost", python=True)
    with open(path, "rb") as fh:
        st, _ = wait_task(api, api.nodes("pve").storage("local").upload.post(content="vztmpl", filename=fh))
    assert st["exitstatus"] == "OK"
    create(api, 175, f"local:vztmpl/{PYTHON_TEMPLATE_NAME}", start=1)
    res = pve_host.exec_in_container(175, ["python3", "-c", "import ssl, venv, sys; print(sys.version_info[0])"])
    assert (res.returncode, res.stdout) == (0, "3\n"), res.stderr
    destroy(api, 175)


def test_calls_are_recorded_without_secrets(pve_host, template):
    pve_host.reset_calls()
    tok, root = token_api(pve_host), root_api(pve_host)
    tok.nodes("pve").storage("local").content.get(content="vztmpl")
    root.cluster.resources.get(type="vm")
    with pytest.raises(ResourceException):
        root.nodes("pve").lxc.post(vmid=180, ostemplate=template, password="s3cret-pass", memory="x")
    assert pve_host.calls() == [  # proxmoxer's password login itself (POST /access/ticket) is not recorded
        {"method": "GET", "path": "/nodes/pve/storage/local/content", "params": {"content": "vztmpl"},
         "auth": "token"},
        {"method": "GET", "path": "/cluster/resources", "params": {"type": "vm"}, "auth": "ticket"},
        {"method": "POST", "path": "/nodes/pve/lxc", "auth": "ticket",
         "params": {"vmid": "180", "ostemplate": template, "password": "<redacted>", "memory": "x"}},
    ]
    recorded = (Path(pve_host.state_dir) / "calls.jsonl").read_text()
    assert "s3cret-pass" not in recorded and pve_host.token_secret not in recorded
    assert pve_host.root_password not in recorded


@pytest.mark.skipif(missing_prerequisites() is not None, reason=str(missing_prerequisites()))
def test_up_and_down_commands_clean_up(tmp_path):
    state = tmp_path / "manual"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    up = subprocess.run([sys.executable, "-m", "tests.pve_testhost", "up", "--state-dir", str(state)],
                        capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120, check=False)
    assert up.returncode == 0, up.stderr
    info = json.loads((state / "connection.json").read_text())
    assert requests.get(f"{info['api_url']}/version", verify=info["ca_cert"],
                        headers={"Authorization": f"PVEAPIToken={info['token_id']}={info['token_secret']}"}
                        ).json()["data"]["release"] == "9.1"
    down = subprocess.run([sys.executable, "-m", "tests.pve_testhost", "down", "--state-dir", str(state)],
                          capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=120, check=False)
    assert down.returncode == 0, down.stderr
    assert not Path(f"/proc/{info['pid']}").exists() and not (state / "connection.json").exists()
