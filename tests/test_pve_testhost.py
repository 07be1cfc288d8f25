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
from tests.pve_testhost.tasks import parse_upid
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


def api_request(h, method, path, token=True, **kwargs):
    headers = {"Authorization": f"PVEAPIToken={h.token_id}={h.token_secret}"} if token else {}
    return requests.request(method, f"{h.api_url}{path}", verify=h.ca_cert, headers=headers, **kwargs)


def test_bad_parameters_get_pves_400_shape(pve_host):
    r = api_request(pve_host, "POST", "/nodes/pve/lxc",
                    data={"vmid": "12", "ostemplate": "local:vztmpl/x.tar.zst", "cores": "many",
                          "lxc.cgroup2.devices.allow": "c 195:* rwm"})
    assert r.status_code == 400
    assert r.reason == "Parameter verification failed."
    assert r.json() == {"data": None, "message": "Parameter verification failed.\n", "errors": {
        "vmid": "invalid format - value does not look like a valid VM ID\n",
        "cores": "type check ('integer') failed - got 'many'",
        "lxc.cgroup2.devices.allow": "property is not defined in schema and the schema does not allow "
                                     "additional properties"}}
    with pytest.raises(ResourceException) as exc:  # and proxmoxer sees them as PVE's
        token_api(pve_host).nodes("pve").lxc(100).config.put(**{"lxc.idmap": "u 0 100000 65536"})
    assert exc.value.status_code == 400 and "lxc.idmap" in exc.value.errors


def test_error_bodies_carry_the_message_beside_errors(pve_host):
    """pve-http-server Formatter/Standard.pm prepare_response_data (5.2+, fix #6503): an error answer
    is {"data": null, "message": ...} plus "errors" for parameter errors; the reason phrase is the
    message's first line (AnyEvent.pm response). The texts are pve-container's and pve-manager's."""
    r = api_request(pve_host, "GET", "/nodes/pve/lxc/999/config")  # AbstractConfig.pm load_config
    assert (r.status_code, r.reason) == (500, "Configuration file 'nodes/pve/lxc/999.conf' does not exist")
    assert r.json() == {"data": None, "message": "Configuration file 'nodes/pve/lxc/999.conf' does not exist\n"}
    r = api_request(pve_host, "GET", "/nodes/pve/nosuch")  # HTTPServer.pm rest_handler
    assert r.status_code == 501
    assert r.json() == {"data": None, "message": "Method 'GET /nodes/pve/nosuch' not implemented"}
    r = api_request(pve_host, "POST", "/nodes/pve/lxc", data={"vmid": "150", "ostemplate": "local:vztmpl/x.tar.zst",
                                                               "dev0": "/dev/nvidia0"})
    assert (r.status_code, r.json()) == (403, {"data": None, "message": "Permission check failed (configuring "
                                               "device passthrough is only allowed for root@pam)\n"})
    r = api_request(pve_host, "GET", "/nodes/pve2/lxc")  # proxied to a node the cluster lacks
    assert r.status_code == 500 and r.json()["message"] == (
        "hostname lookup 'pve2' failed - failed to get address info for: pve2: Name or service not known\n")
    r = api_request(pve_host, "PUT", "/nodes/pve/lxc/999/config", data={"vmid": "998", "memory": "1024"})
    assert r.status_code == 400 and r.json()["errors"] == {
        "vmid": "duplicate parameter (already defined in URI) with conflicting values!"}


def test_auth_modes_and_refusals(pve_host):
    """pve-manager HTTPServer.pm auth_handler and pve-http-server AnyEvent.pm: a failed login check is
    a 401 whose reason is the error and which has no body at all; a wrong password at /access/ticket
    (pve-access-control API2/AccessControl.pm create_ticket) is an ordinary error answer."""
    url = f"{pve_host.api_url}/version"
    no_auth = requests.get(url, verify=pve_host.ca_cert)
    assert (no_auth.status_code, no_auth.reason, no_auth.content) == (401, "No ticket", b"")
    bad = {"Authorization": f"PVEAPIToken={pve_host.token_id}=wrong"}
    wrong_token = requests.get(url, verify=pve_host.ca_cert, headers=bad)
    assert (wrong_token.status_code, wrong_token.reason, wrong_token.content) == (401, "Authentication failed!", b"")
    unknown_path = requests.get(f"{pve_host.api_url}/nodes/pve/nosuch", verify=pve_host.ca_cert)
    assert unknown_path.status_code == 401  # authentication comes before routing
    login = requests.post(f"{pve_host.api_url}/access/ticket", verify=pve_host.ca_cert,
                          data={"username": "root@pam", "password": pve_host.root_password}).json()["data"]
    cookies = {"PVEAuthCookie": login["ticket"]}
    assert requests.get(url, verify=pve_host.ca_cert, cookies=cookies).json()["data"]["release"] == "9.1"
    bad_ticket = requests.get(url, verify=pve_host.ca_cert, cookies={"PVEAuthCookie": login["ticket"][:-4] + "0000"})
    assert (bad_ticket.status_code, bad_ticket.reason, bad_ticket.content) == (401, "Authentication failed!", b"")
    no_csrf = requests.put(f"{pve_host.api_url}/nodes/pve/lxc/100/config", verify=pve_host.ca_cert,
                           cookies=cookies, data={"memory": "1024"})
    assert (no_csrf.status_code, no_csrf.reason, no_csrf.content) == (
        401, "Permission denied - invalid csrf token", b"")
    wrong = requests.post(f"{pve_host.api_url}/access/ticket", verify=pve_host.ca_cert,
                          data={"username": "root@pam", "password": "nope"})
    assert (wrong.status_code, wrong.reason) == (401, "authentication failure")
    assert wrong.json() == {"data": None, "message": "authentication failure\n"}
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


def test_description_is_accepted_stored_and_returned_like_pve(pve_host, template):
    """pve-container: create_vm and update_vm take description; write_pct_config stores it as
    '#'-comment lines (encode_text); GET config (parse_pct_config) returns it with a newline per line;
    it is fast-plugged ($LXC_FASTPLUG_OPTIONS), so a running CT takes it at once; pct config prints it
    encoded on one line (CLI/pct.pm)."""
    api = root_api(pve_host)
    create(api, 190, template, hostname="described", description="GPU trainer: 2 x H200\n100% busy")
    assert api.nodes("pve").lxc(190).config.get()["description"] == "GPU trainer: 2 x H200\n100% busy\n"
    assert pve_host.pve_conf(190).read_text().splitlines()[:2] == ["#GPU trainer%3A 2 x H200", "#100%25 busy"]
    wait_task(api, api.nodes("pve").lxc(190).status.start.post())
    token_api(pve_host).nodes("pve").lxc(190).config.put(description="retrained")
    assert api.nodes("pve").lxc(190).config.get(current=1)["description"] == "retrained\n"
    assert "description" not in [p["key"] for p in api.nodes("pve").lxc(190).pending.get() if "pending" in p]
    assert "description: retrained%0A" in pve_host.ssh("pct config 190").stdout.splitlines()
    api.nodes("pve").lxc(190).config.put(delete="description")
    assert "description" not in api.nodes("pve").lxc(190).config.get()
    assert not pve_host.pve_conf(190).read_text().startswith("#")
    destroy(api, 190)


def test_tasks_of_an_api_token_report_user_and_tokenid(pve_host, template):
    """The UPID carries the token id as the user (HTTPServer.pm auth_handler: the token id is the
    user; pve-common UPID.pm encode); pve-manager API2/Tasks.pm read_task_status and node_tasks split
    it into user 'root@pam' and tokenid 'ci' (convert_token_task). Ticket tasks have no tokenid."""
    tok, root = token_api(pve_host), root_api(pve_host)
    upid = create(tok, 191, template)
    assert f":vzcreate:191:{pve_host.token_id}:" in upid
    st = tok.nodes("pve").tasks(upid).status.get()
    assert (st["user"], st["tokenid"], st["exitstatus"], st["upid"]) == ("root@pam", "ci", "OK", upid)
    listed = {t["upid"]: t for t in tok.nodes("pve").tasks.get(vmid=191)}
    assert (listed[upid]["user"], listed[upid]["tokenid"], listed[upid]["status"]) == ("root@pam", "ci", "OK")
    assert listed[upid]["endtime"] >= listed[upid]["starttime"]
    assert [t["tokenid"] for t in tok.cluster.tasks.get() if t["upid"] == upid] == ["ci"]
    start = root.nodes("pve").lxc(191).status.start.post()
    wait_task(root, start)
    st = root.nodes("pve").tasks(start).status.get()
    assert st["user"] == "root@pam" and "tokenid" not in st
    by_type = tok.nodes("pve").tasks.get(typefilter="vzstart", vmid=191, userfilter="root@pam")
    assert [t["upid"] for t in by_type] == [start]
    # a failed task lists under errors=1; a bad or unknown UPID is a parameter error, as on PVE
    assert upid not in [t["upid"] for t in tok.nodes("pve").tasks.get(errors=1)]
    r = api_request(pve_host, "GET", f"/nodes/pve/tasks/{upid.replace(':vzcreate:', ':vzstart:')}/status")
    assert (r.status_code, r.json()["errors"]) == (400, {"upid": "no such task"})
    r = api_request(pve_host, "GET", "/nodes/pve/tasks/UPID:nonsense/status")
    assert (r.status_code, r.json()["errors"]) == (400, {"upid": "unable to parse worker upid"})
    destroy(root, 191)


def test_status_current_always_has_swap_and_a_stopped_ct_reports_its_rootfs_size(pve_host, template):
    """pve-container LXC.pm vmstatus: mem and swap are always there (0 for a stopped CT, the cgroup's
    counters for a running one); a stopped CT's maxdisk is its rootfs size= (4 GiB without one),
    maxswap the configured swap; API2/LXC/Status.pm vm_status adds the HA state."""
    api = token_api(pve_host)
    create(api, 192, template, rootfs="local:2", swap=256, memory=1024, cores=2)
    st = api.nodes("pve").lxc(192).status.current.get()
    assert (st["status"], st["maxdisk"], st["disk"], st["swap"], st["mem"]) == ("stopped", 2 * 1024 ** 3, 0, 0, 0)
    assert (st["maxswap"], st["maxmem"], st["cpus"], st["ha"]) == (256 * 1024 ** 2, 1024 ** 3, 2, {"managed": 0})
    assert "template" not in st and "pid" not in st
    wait_task(api, api.nodes("pve").lxc(192).status.start.post())
    st = api.nodes("pve").lxc(192).status.current.get()
    assert st["status"] == "running" and st["pid"] > 1 and st["mem"] > 0
    assert isinstance(st["swap"], int) and st["maxdisk"] == 2 * 1024 ** 3
    listed = {c["vmid"]: c for c in api.nodes("pve").lxc.get()}[192]  # vmlist: the same entries, less ha
    assert set(st) - set(listed) == {"ha"} and listed["maxdisk"] == 2 * 1024 ** 3 and "swap" in listed
    destroy(api, 192)


def test_delete_content_routes_volume_ids_with_slashes(pve_host, template, tmp_path):
    """pve-storage API2/Storage/Status.pm mounts Content with fragmentDelimiter '' (the rest of the
    path is the volume id, slashes and all); Content.pm delete resolves it (real_volume_id) and runs
    an 'imgdel' task with the storage as its id that logs "Removed volume '<volid>'"."""
    api = token_api(pve_host)
    names = [f"debian-12-scratch{i}_1.0-1_amd64.tar.zst" for i in range(3)]
    src = build_test_template(REPO_ROOT / "build" / "testhost")
    for name in names:
        copy = tmp_path / name
        copy.write_bytes(src.read_bytes())
        with open(copy, "rb") as fh:
            wait_task(api, api.nodes("pve").storage("local").upload.post(content="vztmpl", filename=fh))
    volids = [f"local:vztmpl/{n}" for n in names]
    assert set(volids) <= {i["volid"] for i in api.nodes("pve").storage("local").content.get(content="vztmpl")}
    upids = [api.nodes("pve").storage("local").content(volids[0]).delete()]  # proxmoxer: a literal '/'
    r = api_request(pve_host, "DELETE", f"/nodes/pve/storage/local/content/local%3Avztmpl%2F{names[1]}")
    upids.append(r.json()["data"])
    r = api_request(pve_host, "DELETE", f"/nodes/pve/storage/local/content/vztmpl/{names[2]}")  # no storage prefix
    upids.append(r.json()["data"])
    for upid, volid in zip(upids, volids):
        assert parse_upid(upid)["type"] == "imgdel" and parse_upid(upid)["id"] == "local"
        st, _ = wait_task(api, upid)
        assert st["exitstatus"] == "OK"
        assert f"Removed volume '{volid}'" in [line["t"] for line in api.nodes("pve").tasks(upid).log.get()]
    left = {i["volid"] for i in api.nodes("pve").storage("local").content.get(content="vztmpl")}
    assert not set(volids) & left and template in left
    # a volume that is not there: PVE's free_image only warns (plain warn, no WARNINGS count)
    upid = api.nodes("pve").storage("local").content("local:vztmpl/gone_1.0_amd64.tar.zst").delete()
    st, _ = wait_task(api, upid)
    assert st["exitstatus"] == "OK"
    assert [line["t"] for line in api.nodes("pve").tasks(upid).log.get()][:2] == [
        "disk image '/var/lib/vz/template/cache/gone_1.0_amd64.tar.zst' does not exist",
        "Removed volume 'local:vztmpl/gone_1.0_amd64.tar.zst'"]
    r = api_request(pve_host, "DELETE", "/nodes/pve/storage/local/content/other:vztmpl/x.tar.zst")
    assert (r.status_code, r.json()["errors"]) == (400, {"volume": "storage ID mismatch (other != local)\n"})


def test_create_with_a_missing_template_fails_in_its_task_like_pve(pve_host):
    """pve-container API2/LXC.pm create_vm checks only the volume id before forking
    (pve-storage Storage.pm check_volume_access); the vzcreate task then fails where it opens the
    archive (Plugin.pm activate_volume: "volume '<volid>' does not exist", warned once by
    LXC/Create.pm archive_is_oci_format), prefixed "unable to create CT <vmid> - "."""
    api = token_api(pve_host)
    volid = "local:vztmpl/debian-12-missing_1.0-1_amd64.tar.zst"
    upid = api.nodes("pve").lxc.post(vmid=193, ostemplate=volid)
    st, _ = wait_task(api, upid)
    assert st["exitstatus"] == f"unable to create CT 193 - volume '{volid}' does not exist"
    lines = [line["t"] for line in api.nodes("pve").tasks(upid).log.get()]
    assert lines[-2:] == [f"volume '{volid}' does not exist",
                          f"TASK ERROR: unable to create CT 193 - volume '{volid}' does not exist"]
    assert not pve_host.container_exists(193)
    with pytest.raises(ResourceException) as exc:  # a volume of the wrong content type: refused at once
        api.nodes("pve").lxc.post(vmid=193, ostemplate="local:iso/debian.iso")
    assert exc.value.status_code == 500
    assert exc.value.content == "unable to use volume local:iso/debian.iso - content type needs to be 'vztmpl'"
    with pytest.raises(ResourceException, match="storage 'nfs' does not exist"):
        api.nodes("pve").lxc.post(vmid=193, ostemplate="nfs:vztmpl/x.tar.zst")


def test_create_refusals_carry_pves_schema_messages(pve_host):
    """The 400 bodies for a vmid below 100 (pve_verify_vmid), an IPv4 without prefix in net0
    (pve-container $netconf_desc ip: pve-ipv4-config) and a hostname with '_' (dns-name), all from
    pve-common JSONSchema.pm."""
    base = {"ostemplate": "local:vztmpl/x.tar.zst"}
    cases = [({"vmid": "99"}, {"vmid": "invalid format - value does not look like a valid VM ID\n"}),
             ({"vmid": "194", "net0": "name=eth0,bridge=vmbr0,ip=192.168.1.20"},
              {"net0": "invalid format - format error\nnet0.ip: invalid format - value does not look like a "
                       "valid ipv4 network configuration\n\n"}),
             ({"vmid": "194", "hostname": "gpu_trainer"},
              {"hostname": "invalid format - value does not look like a valid DNS name\n"})]
    for params, errors in cases:
        r = api_request(pve_host, "POST", "/nodes/pve/lxc", data={**base, **params})
        assert (r.status_code, r.json()) == (400, {"data": None, "errors": errors,
                                                   "message": "Parameter verification failed.\n"})
    assert not pve_host.container_exists(194)


def test_config_updates_answer_like_update_vm(pve_host, template):
    """pve-container API2/LXC/Config.pm update_vm and LXC/Config.pm update_pct_config refusals."""
    api = root_api(pve_host)
    create(api, 195, template)
    ct = api.nodes("pve").lxc(195)
    with pytest.raises(ResourceException) as exc:
        ct.config.put(delete="colour")
    assert exc.value.errors == {"delete": "unknown option 'colour'"}
    with pytest.raises(ResourceException) as exc:
        ct.config.put(memory=1024, delete="memory")
    assert exc.value.errors == {"delete": "you can't use '-memory' and -delete memory' at the same time"}
    with pytest.raises(ResourceException, match="unable to delete required option 'rootfs'"):
        ct.config.put(delete="rootfs")
    with pytest.raises(ResourceException, match="unable to modify read-only option: 'unprivileged'"):
        ct.config.put(unprivileged=0)
    with pytest.raises(ResourceException, match="no options specified"):
        ct.config.put()
    ct.config.put(delete="searchdomain")  # not set: PVE warns and carries on
    with pytest.raises(ResourceException, match=r"CT 195 already exists on node 'pve'"):
        api.nodes("pve").lxc.post(vmid=195, ostemplate=template, force=1)  # force only counts with restore
    destroy(api, 195)
    create(api, 196, template, unprivileged=0)  # create_vm writes 'unprivileged: 1' or nothing
    assert "unprivileged" not in api.nodes("pve").lxc(196).config.get()
    destroy(api, 196)
