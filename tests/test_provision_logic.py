"""Unit tests of the provisioning collection's pure logic: property strings, the desired config,
the diff against what PVE reports, GPU discovery parsing and the raw lxc.* line edit."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

COLLECTIONS = Path(__file__).resolve().parents[1] / "ansible" / "collections"
if str(COLLECTIONS) not in sys.path:
    sys.path.insert(0, str(COLLECTIONS))

from ansible_collections.dflash.proxmox.plugins.module_utils import pve_config as cfg
from ansible_collections.dflash.proxmox.plugins.module_utils import pve_host as host
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveError

# What a real 2-GPU host prints (format of `ls -l /dev/nvidia*` with a directory argument).
LS_REAL = """\
crw-rw-rw- 1 root root 195,   0 Nov 30 10:00 /dev/nvidia0
crw-rw-rw- 1 root root 195,   1 Nov 30 10:00 /dev/nvidia1
crw-rw-rw- 1 root root 195, 254 Nov 30 10:00 /dev/nvidia-modeset
crw-rw-rw- 1 root root 508,   0 Nov 30 10:00 /dev/nvidia-uvm
crw-rw-rw- 1 root root 508,   1 Nov 30 10:00 /dev/nvidia-uvm-tools
crw-rw-rw- 1 root root 195, 255 Nov 30 10:00 /dev/nvidiactl

/dev/nvidia-caps:
total 0
cr-------- 1 root root 511, 1 Nov 30 10:00 nvidia-cap1
cr--r--r-- 1 root root 511, 2 Nov 30 10:00 nvidia-cap2
"""
PROC_DEVICES = """\
Character devices:
  1 mem
195 nvidia
195 nvidiactl
508 nvidia-uvm
511 nvidia-caps

Block devices:
  8 sd
"""


def base_params(**over):
    p = {"hostname": "trainer1", "cores": 4, "memory": 8192, "swap": 0, "cpulimit": None, "cpuunits": None,
         "onboot": True, "unprivileged": True, "nameserver": None, "searchdomain": None, "timezone": None,
         "ostype": None, "arch": None, "startup": None, "tags": ["dflash", "gpu"], "features": {"nesting": True},
         "netif": [{"name": "eth0", "bridge": "vmbr0", "ip": "dhcp"}],
         "devices": [{"path": "/dev/nvidia0", "mode": "0666"}]}
    p.update(over)
    return p


# ---- property strings -----------------------------------------------------------------------------
def test_propstring_round_trip_keeps_default_key_first():
    props = cfg.parse_propstring("/dev/nvidia0,mode=0666,gid=44", "path")
    assert props == {"path": "/dev/nvidia0", "mode": "0666", "gid": "44"}
    assert cfg.build_propstring(props, "path") == "/dev/nvidia0,gid=44,mode=0666"


def test_propstring_without_default_key_rejects_bare_items():
    with pytest.raises(cfg.ConfigError, match="not key=value"):
        cfg.parse_propstring("eth0,bridge=vmbr0")


@pytest.mark.parametrize("text,gib", [("8G", 8), ("8192M", 8), ("1T", 1024), ("0.5G", 0.5), ("4", 4)])
def test_disk_sizes(text, gib):
    assert cfg.size_in_gib(text) == pytest.approx(gib)


# ---- validation -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["99", "0", "1000000000", "abc", "", "12.5", None])
def test_invalid_vmids_name_the_variable(bad):
    with pytest.raises(cfg.ConfigError, match="proxmox_lxc_vmid"):
        cfg.validate_vmid(bad)


def test_valid_vmid():
    assert cfg.validate_vmid("200") == 200


def test_bad_hostname_and_memory_are_refused():
    with pytest.raises(cfg.ConfigError, match="hostname"):
        cfg.desired_config(base_params(hostname="bad_name!"))
    with pytest.raises(cfg.ConfigError, match="minimum of 16"):
        cfg.desired_config(base_params(memory=8))


def test_device_paths_and_modes_are_checked():
    with pytest.raises(cfg.ConfigError, match="under /dev/"):
        cfg.desired_config(base_params(devices=[{"path": "/etc/passwd"}]))
    with pytest.raises(cfg.ConfigError, match="octal"):
        cfg.desired_config(base_params(devices=[{"path": "/dev/nvidia0", "mode": 666}]))
    with pytest.raises(cfg.ConfigError, match="unknown option"):
        cfg.desired_config(base_params(devices=[{"path": "/dev/nvidia0", "colour": "red"}]))


# ---- desired config and diff ----------------------------------------------------------------------
def test_desired_config_in_pve_string_form():
    want = cfg.desired_config(base_params())
    assert want == {"hostname": "trainer1", "cores": "4", "memory": "8192", "swap": "0", "onboot": "1",
                    "unprivileged": "1", "tags": "dflash;gpu", "features": "nesting=1",
                    "net0": "bridge=vmbr0,ip=dhcp,name=eth0", "dev0": "/dev/nvidia0,mode=0666"}


def current_from_pve():
    """GET config as PVE returns it for a container made from base_params()."""
    return {"hostname": "trainer1", "cores": 4, "memory": 8192, "swap": 0, "onboot": 1, "unprivileged": 1,
            "tags": "gpu;dflash", "features": "nesting=1", "arch": "amd64", "ostype": "debian",
            "net0": "name=eth0,bridge=vmbr0,hwaddr=BC:24:11:00:00:01,ip=dhcp,type=veth",
            "dev0": "/dev/nvidia0,mode=0666", "rootfs": "local:200/vm-200-disk-0.raw,size=8G",
            "digest": "0123abcd"}


def test_no_change_when_pve_matches_even_with_filled_in_keys():
    updates, deletes, conflicts = cfg.diff_config(cfg.desired_config(base_params()), current_from_pve())
    assert (updates, deletes, conflicts) == ({}, [], [])


def test_changes_and_removals_are_found():
    current = current_from_pve()
    current["dev1"] = "/dev/nvidia1,mode=0666"
    current["features"] = "keyctl=1,nesting=1"
    want = cfg.desired_config(base_params(memory=16384, devices=[{"path": "/dev/nvidia0", "mode": "0660"}]))
    updates, deletes, conflicts = cfg.diff_config(want, current)
    assert updates == {"memory": "16384", "dev0": "/dev/nvidia0,mode=0660", "features": "nesting=1"}
    assert deletes == ["dev1"]
    assert conflicts == []
    assert cfg.needs_restart(updates, deletes) == ["dev0", "dev1", "features"]


def test_defaults_omitted_by_pve_count_as_set():
    current = current_from_pve()
    del current["onboot"]
    updates, _, _ = cfg.diff_config(cfg.desired_config(base_params(onboot=False)), current)
    assert "onboot" not in updates
    updates, _, _ = cfg.diff_config(cfg.desired_config(base_params(onboot=True)), current)
    assert updates == {"onboot": "1"}


def test_privileged_switch_is_a_conflict_not_an_update():
    updates, _, conflicts = cfg.diff_config(cfg.desired_config(base_params(unprivileged=False)),
                                            current_from_pve())
    assert "unprivileged" not in updates
    assert len(conflicts) == 1 and "only be set at creation" in conflicts[0]


def test_changed_network_option_is_an_update_but_hwaddr_is_ignored():
    want = cfg.desired_config(base_params(netif=[{"name": "eth0", "bridge": "vmbr1", "ip": "dhcp"}]))
    updates, _, _ = cfg.diff_config(want, current_from_pve())
    assert updates == {"net0": "bridge=vmbr1,ip=dhcp,name=eth0"}


def test_render_and_apply_give_a_readable_diff():
    current = current_from_pve()
    after = cfg.apply_changes(current, {"memory": "16384"}, ["dev0"])
    before_text, after_text = cfg.render_config(current), cfg.render_config(after)
    assert "memory: 8192\n" in before_text and "memory: 16384\n" in after_text
    assert "dev0:" in before_text and "dev0:" not in after_text
    assert "digest" not in before_text


def test_rootfs_grows_but_never_shrinks():
    assert cfg.rootfs_plan(16, "local:200/vm-200-disk-0.raw,size=8G") == 16
    assert cfg.rootfs_plan(8, "local:200/vm-200-disk-0.raw,size=8192M") is None
    with pytest.raises(cfg.ConfigError, match="can't shrink"):
        cfg.rootfs_plan(4, "local:200/vm-200-disk-0.raw,size=8G")


# ---- GPU discovery --------------------------------------------------------------------------------
def test_driver_version_of_real_and_stand_in_hosts():
    real = ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  "
            "(dvs-builder@U16-I3-B03-4-3)  Tue Sep 23 09:43:49 UTC 2025\nGCC version:  gcc version 12.2.0")
    assert host.parse_driver_version(real) == "580.95.05"
    assert host.parse_driver_version("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu") == "550.54.14"
    with pytest.raises(PveError, match="no NVIDIA kernel module"):
        host.parse_driver_version("cat: /proc/driver/nvidia/version: No such file or directory")


def test_dynamic_majors_come_from_proc_devices():
    majors = host.parse_proc_devices(PROC_DEVICES)
    assert majors["nvidia-uvm"] == 508 and majors["nvidia-caps"] == 511
    assert "sd" not in majors  # block devices are not char majors


def test_ls_parsing_includes_caps_directory_entries():
    nodes = host.parse_ls_l(LS_REAL)
    paths = [n["path"] for n in nodes]
    assert "/dev/nvidia-caps/nvidia-cap1" in paths and "/dev/nvidia-uvm" in paths
    assert next(n for n in nodes if n["path"] == "/dev/nvidiactl")["minor"] == 255


def test_passthrough_selects_gpus_and_shared_nodes():
    nodes = host.parse_ls_l(LS_REAL)
    chosen = [n["path"] for n in host.passthrough_nodes(nodes, [1])]
    assert chosen == ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                      "/dev/nvidia-modeset", "/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"]
    with pytest.raises(PveError, match=r"GPU\(s\) \[3\] not found"):
        host.passthrough_nodes(nodes, [3])
    no_uvm = [n for n in nodes if "uvm" not in n["path"]]
    with pytest.raises(PveError, match="nvidia-uvm is missing"):
        host.passthrough_nodes(no_uvm, "all")


def test_dev_entries_and_raw_lines():
    chosen = host.passthrough_nodes(host.parse_ls_l(LS_REAL), "all")
    assert host.dev_entries(chosen)[0] == {"path": "/dev/nvidia0", "mode": "0666"}
    lines = host.raw_lxc_lines(chosen)
    assert lines[:6] == ["lxc.cgroup2.devices.allow: c 195:0 rwm", "lxc.cgroup2.devices.allow: c 195:1 rwm",
                         "lxc.cgroup2.devices.allow: c 195:255 rwm", "lxc.cgroup2.devices.allow: c 508:* rwm",
                         "lxc.cgroup2.devices.allow: c 195:254 rwm", "lxc.cgroup2.devices.allow: c 511:* rwm"]
    assert "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file" in lines
    assert lines.count("lxc.mount.entry: /dev/nvidia-caps dev/nvidia-caps none bind,optional,create=dir") == 1


def test_nvidia_smi_list_parsing():
    gpus = host.parse_nvidia_smi_l("GPU 0: NVIDIA H200 (UUID: GPU-1234)\nGPU 1: NVIDIA H200 (UUID: GPU-5678)\n")
    assert [g["index"] for g in gpus] == [0, 1] and gpus[1]["uuid"] == "GPU-5678"


# ---- raw lxc.* lines in the host's conf -----------------------------------------------------------
CONF = """\
arch: amd64
hostname: trainer1
memory: 8192
lxc.cgroup2.devices.allow: c 226:* rwm
lxc.cgroup2.devices.allow: c 195:* rwm
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
lxc.mount.entry: /srv/data srv/data none bind,create=dir

[snap1]
arch: amd64
lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file
"""


def test_merge_replaces_only_our_lines_in_the_main_section():
    want = ["lxc.cgroup2.devices.allow: c 195:1 rwm",
            "lxc.mount.entry: /dev/nvidia1 dev/nvidia1 none bind,optional,create=file"]
    merged = host.merge_raw_lines(CONF, want, {195, 508})
    main, snap = merged.split("[snap1]")
    assert "c 226:* rwm" in main and "/srv/data" in main  # other users' lines stay
    assert "c 195:* rwm" not in main and "/dev/nvidia0" not in main
    assert main.rstrip().endswith(want[1])
    assert "/dev/nvidia0" in snap  # snapshots are history, never edited
    assert host.merge_raw_lines(merged, want, {195, 508}) == merged  # idempotent


def test_merge_with_no_lines_removes_ours():
    merged = host.merge_raw_lines(CONF, [], {195})
    assert "nvidia" not in merged.split("[snap1]")[0]


# ---- task waits: fail fast with the last log lines ------------------------------------------------
class FakeTasks:
    """Stands in for proxmoxer's nodes(n).tasks(upid) chain: a task that fails after two polls."""

    def __init__(self, exitstatus, log_lines):
        self.polls = 0
        self.exitstatus = exitstatus
        self.log_lines = log_lines

    def nodes(self, node):
        return self

    def tasks(self, upid):
        return self

    @property
    def status(self):
        return self

    @property
    def log(self):
        return _Log(self.log_lines)

    def get(self, **_):
        self.polls += 1
        if self.polls < 3:
            return {"status": "running"}
        return {"status": "stopped", "exitstatus": self.exitstatus}


class _Log:
    def __init__(self, lines):
        self.lines = lines

    def get(self, **_):
        return [{"n": i + 1, "t": t} for i, t in enumerate(self.lines)]


def client_with(api, **params):
    from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveClient

    client = PveClient.__new__(PveClient)  # no login: the wait logic alone
    client.api, client.p = api, dict(task_timeout=30, task_log_lines=3, **params)
    return client


def test_failed_task_raises_at_once_with_its_last_log_lines():
    from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import TaskFailed

    lines = [f"line {i}" for i in range(10)] + ["TASK ERROR: unable to create CT 200 - no space left"]
    api = FakeTasks("unable to create CT 200 - no space left", lines)
    import time
    start = time.monotonic()
    with pytest.raises(TaskFailed) as info:
        client_with(api).wait("UPID:pve:0000ABCD:00001234:65000000:vzcreate:200:root@pam:", "creating container 200")
    assert time.monotonic() - start < 5  # not the 30 s timeout
    assert "creating container 200 failed on node pve: unable to create CT 200" in info.value.msg
    assert info.value.details["task_log"] == ["line 8", "line 9", lines[-1]]


def test_ok_and_warnings_tasks_succeed():
    for status in ("OK", "WARNINGS: 2"):
        assert client_with(FakeTasks(status, []) ).wait("UPID:pve:1:2:3:vzstart:200:root@pam:", "x")["exitstatus"] == status


def test_missing_credentials_are_named():
    from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveClient

    with pytest.raises(PveError, match="no Proxmox credentials.*PROXMOX_PASSWORD"):
        PveClient({"api_host": "h", "node": "pve", "api_port": 8006, "api_password": "", "api_token_id": "",
                   "api_token_secret": "", "validate_certs": True, "ca_path": "", "api_timeout": 5})


# ---- who may set dev[n] ----------------------------------------------------------------------------
class _FakePve:
    def __init__(self, version, auth, user="root@pam"):
        self.version, self.auth, self.user = {"version": version}, auth, user

    def version_tuple(self):
        from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import PveClient

        return PveClient.version_tuple(self)

    def can_pass_devices(self):
        return self.auth == "ticket" and self.user == "root@pam"


def _lxc_with(pve):
    from ansible_collections.dflash.proxmox.plugins.modules.pve_lxc import Lxc

    lxc = Lxc.__new__(Lxc)
    lxc.pve = pve
    return lxc


def test_dev_entries_need_pve_8_1():
    with pytest.raises(PveError, match=r"needs Proxmox VE 8\.1 or newer; this host runs 7\.4-3.*proxmox_gpu_method: raw"):
        _lxc_with(_FakePve("7.4-3", "ticket")).check_device_rights(["dev0"])


def test_dev_entries_refused_plainly_with_a_token_or_another_user():
    with pytest.raises(PveError, match="an API token is configured"):
        _lxc_with(_FakePve("9.1.1", "token")).check_device_rights(["dev0"])
    with pytest.raises(PveError, match="the login user is admin@pve"):
        _lxc_with(_FakePve("8.2.4", "ticket", "admin@pve")).check_device_rights(["dev0"])
    _lxc_with(_FakePve("8.1.3", "ticket")).check_device_rights(["dev0"])  # root@pam ticket: allowed
    _lxc_with(_FakePve("7.0", "token")).check_device_rights([])  # no devices: nothing to check
