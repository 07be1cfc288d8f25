#!/usr/bin/python
# ruff: noqa: EXE001 - Ansible's module shebang, on a file that must not be executable (ansible-test)
# Create or update one LXC container through the PVE API, with check and diff mode, dev[n]
# passthrough, a controlled reboot for pending changes and fail-fast task waits.
from __future__ import annotations

DOCUMENTATION = r"""
module: pve_lxc
short_description: Create or update a Proxmox VE LXC container (check and diff mode, dev[n] passthrough)
description:
  - Validates everything first (vmid, node, storage, template, credentials), then creates the container or
    updates its configuration so that it matches. A vmid used by a container with another hostname, or by a
    VM, is refused.
  - Changes PVE can't apply to a running container stay pending; they are reported and, with
    O(reboot_for_pending=true), applied by a reboot.
  - C(dev[n]) entries need a C(root@pam) password (ticket) login; with an API token the module says so and
    changes nothing.
version_added: "0.1.0"
extends_documentation_fragment:
  - dflash.proxmox.pve
  - dflash.proxmox.pve.SSH
options:
  vmid:
    description: Container id (100..999999999).
    type: str
    required: true
  hostname:
    description: Container hostname; also guards against taking over another container's vmid.
    type: str
    required: true
  state:
    description: V(present) creates or updates; V(started) also starts it; V(stopped) shuts it down; V(restarted) reboots it.
    type: str
    choices: [present, started, stopped, restarted]
    default: started
  template:
    description: Template volume id for creation, e.g. C(local:vztmpl/debian-12.tar.zst).
    type: str
  storage:
    description: Storage for the root disk (needs C(rootdir) content).
    type: str
    default: local-lvm
  disk_gb:
    description: Root disk size in GiB; grown when larger than the current size, never shrunk.
    type: float
    default: 8
  cores: {description: CPU cores., type: int}
  memory: {description: Memory in MiB., type: int}
  swap: {description: Swap in MiB., type: int}
  cpulimit: {description: CPU limit (0 = none)., type: float}
  cpuunits: {description: CPU weight., type: int}
  netif:
    description: Network interfaces, in order C(net0), C(net1)...; dicts with the PVE net[n] keys (name, bridge, ip, gw, ...).
    type: list
    elements: raw
    default: []
  features:
    description: Feature flags, e.g. nesting set to true.
    type: dict
    default: {}
  devices:
    description: Device passthrough entries C(dev0), C(dev1)...; dicts with path, mode, uid, gid, deny_write.
    type: list
    elements: raw
    default: []
  unprivileged: {description: Unprivileged container (creation only)., type: bool, default: true}
  onboot: {description: Start at host boot., type: bool}
  startup: {description: Startup order string., type: str}
  tags: {description: Tags., type: list, elements: str}
  nameserver: {description: DNS server(s)., type: str}
  searchdomain: {description: DNS search domain., type: str}
  timezone: {description: Timezone., type: str}
  ostype: {description: OS type (creation only)., type: str}
  arch: {description: Architecture (creation only)., type: str}
  password: {description: Root password inside the container (creation only)., type: str}
  ssh_public_keys: {description: SSH public keys for root (creation only)., type: str}
  reboot_for_pending:
    description: Reboot a running container to apply pending changes.
    type: bool
    default: true
  template_uploading:
    description: In check mode, an earlier task would upload O(template) (and only pretended to); don't call it missing.
    type: bool
    default: false
author: dflash-trainer developers
"""

EXAMPLES = r"""
- name: GPU training container
  dflash.proxmox.pve_lxc:
    api_host: pve.example.org
    api_password: "{{ vault_proxmox_root_password }}"
    node: pve
    vmid: 200
    hostname: trainer1
    template: local:vztmpl/dflash-train.tar.zst
    storage: local-lvm
    disk_gb: 64
    cores: 32
    memory: 262144
    netif: [{name: eth0, bridge: vmbr0, ip: dhcp}]
    devices: [{path: /dev/nvidia0, mode: "0666"}]
"""

RETURN = r"""
created: {description: The container was created., type: bool, returned: always}
rebooted: {description: The container was rebooted to apply changes., type: bool, returned: always}
updates: {description: Keys changed (or that would change in check mode)., type: dict, returned: always}
deletes: {description: Keys removed., type: list, returned: always}
pending: {description: Changes PVE reports as pending (need a reboot)., type: list, returned: always}
status: {description: Container status afterwards (running, stopped, absent in check mode)., type: str, returned: always}
status_before:
  description: >-
    Container status before this call (running, stopped, absent when it did not exist). In check mode status is
    the predicted one (running for a stopped container it would start); this is what can be read from it now.
  type: str
  returned: always
"""

from ansible_collections.dflash.proxmox.plugins.module_utils import pve_config as cfgmod
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_api import (
    PveClient,
    PveError,
    ResourceException,
    TaskFailed,
)
from ansible_collections.dflash.proxmox.plugins.module_utils.pve_module import run_module

# This module's own options (run_module adds the connection options every module takes).
OPTIONS = {
    "vmid": {"type": "str", "required": True},
    "hostname": {"type": "str", "required": True},
    "state": {"type": "str", "default": "started", "choices": ["present", "started", "stopped", "restarted"]},
    "template": {"type": "str"},
    "storage": {"type": "str", "default": "local-lvm"},
    "disk_gb": {"type": "float", "default": 8},
    "cores": {"type": "int"}, "memory": {"type": "int"}, "swap": {"type": "int"},
    "cpulimit": {"type": "float"}, "cpuunits": {"type": "int"},
    "netif": {"type": "list", "elements": "raw", "default": []},
    "features": {"type": "dict", "default": {}},
    "devices": {"type": "list", "elements": "raw", "default": []},
    "unprivileged": {"type": "bool", "default": True},
    "onboot": {"type": "bool"}, "startup": {"type": "str"}, "tags": {"type": "list", "elements": "str"},
    "nameserver": {"type": "str"}, "searchdomain": {"type": "str"}, "timezone": {"type": "str"},
    "ostype": {"type": "str"}, "arch": {"type": "str"},
    "password": {"type": "str", "no_log": True}, "ssh_public_keys": {"type": "str"},
    "reboot_for_pending": {"type": "bool", "default": True},
    "template_uploading": {"type": "bool", "default": False},
}


class Lxc:
    def __init__(self, module):
        self.m = module
        self.p = module.params
        self.check = module.check_mode
        self.result = {"changed": False, "created": False, "rebooted": False, "updates": {}, "deletes": [], "pending": [],
                           "status": "absent", "status_before": "absent", "messages": []}

    # ---- validation first: nothing is touched until all inputs are known good ----------------------
    def validate_offline(self):
        self.vmid = cfgmod.validate_vmid(self.p["vmid"])
        self.desired = cfgmod.desired_config(self.p)
        if self.p["disk_gb"] is not None and self.p["disk_gb"] <= 0:
            raise cfgmod.ConfigError(f"disk_gb {self.p['disk_gb']} must be positive")

    def validate_online(self):
        self.pve = PveClient(self.p)
        self.pve.check_node()
        self.pve.storage(self.p["storage"], "rootdir")
        self.guest = self.pve.find_guest(self.vmid)
        if self.guest is not None:
            if self.guest.get("type") != "lxc":
                raise PveError(f"vmid {self.vmid} is already used by a {self.guest.get('type')} guest "
                               f"{self.guest.get('name')!r} on node {self.guest.get('node')}; choose another "
                               f"proxmox_lxc_vmid")
            if self.guest.get("node") != self.pve.node:
                raise PveError(f"container {self.vmid} exists on node {self.guest.get('node')}, not on "
                               f"{self.pve.node}; migrate it or fix proxmox_node / proxmox_lxc_vmid")

    def check_device_rights(self, device_keys):
        if not device_keys:
            return
        if self.pve.version_tuple() < (8, 1):
            raise PveError(f"device passthrough (dev[n]) needs Proxmox VE 8.1 or newer; this host runs "
                           f"{self.pve.version.get('version')}. Set proxmox_gpu_method: raw to write "
                           f"lxc.cgroup2/lxc.mount.entry lines instead")
        if not self.pve.can_pass_devices():
            how = ("an API token is configured" if self.pve.auth == "token"
                   else f"the login user is {self.pve.user}")
            raise PveError(f"dev[n] device passthrough ({', '.join(device_keys)}) can only be set by root@pam "
                           f"with a password (ticket) login, and {how}: Proxmox VE refuses it for every API "
                           f"token, even root@pam!token. Set proxmox_api_password for root@pam (vault or "
                           f"PROXMOX_PASSWORD), or set proxmox_gpu_method: raw to configure the GPUs with "
                           f"lxc.* lines over SSH. Nothing was changed.")

    # ---- create -------------------------------------------------------------------------------------
    def create(self):
        template = self.p["template"]
        if not template:
            raise PveError(f"container {self.vmid} does not exist and no template is set "
                           f"(proxmox_lxc_template, e.g. local:vztmpl/debian-12-standard_12.7-1_amd64.tar.zst)")
        tstorage = template.split(":", 1)[0]
        if ":" not in template:
            raise PveError(f"template {template!r} is not a volume id like local:vztmpl/<file>")
        self.pve.storage(tstorage, "vztmpl")
        if template not in self.pve.templates(tstorage) and not (self.check and self.p["template_uploading"]):
            raise PveError(f"template {template} is missing on node {self.pve.node}; upload it first "
                           f"(the proxmox_template role does, from proxmox_template_src) or fix proxmox_lxc_template")
        self.check_device_rights([k for k in self.desired if cfgmod.family(k) == "dev"])
        params = dict(self.desired)
        params.update(vmid=self.vmid, ostemplate=template,
                      rootfs=f"{self.p['storage']}:{_gib(self.p['disk_gb'])}")
        if self.p["password"]:
            params["password"] = self.p["password"]
        if self.p["ssh_public_keys"]:
            params["ssh-public-keys"] = self.p["ssh_public_keys"]
        self.result.update(changed=True, created=True, updates=dict(self.desired))
        self.diff_before, self.diff_after = "", cfgmod.render_config(
            dict(self.desired, rootfs=f"{self.p['storage']}:{_gib(self.p['disk_gb'])}", ostemplate=template))
        if self.check:
            return
        node = self.pve.api.nodes(self.pve.node)
        upid = self.pve.call(f"creating container {self.vmid}", node.lxc.post, **params)
        try:
            self.pve.wait(upid, f"creating container {self.vmid}")
        except TaskFailed:
            self.clean_up_failed_create()
            raise
        self.result["status"] = "stopped"

    def clean_up_failed_create(self):
        """PVE normally removes a failed create itself; make sure nothing is left half-done."""
        try:
            if self.pve.find_guest(self.vmid) is None:
                return
            upid = self.pve.lxc(self.vmid).delete(purge=1, force=1)
            self.pve.wait(upid, f"removing the half-created container {self.vmid}", timeout=120)
        except PveError as exc:
            self.result["messages"].append(f"could not remove the half-created container {self.vmid}: {exc.msg}")

    # ---- update -------------------------------------------------------------------------------------
    def update(self):
        ct = self.pve.lxc(self.vmid)
        current = self.pve.call(f"reading container {self.vmid}", ct.config.get)
        self.check_same_hostname(current)
        updates, deletes, grow = self.plan_update(current)
        status = self.pve.call("reading status", ct.status.current.get).get("status", "unknown")
        self.result["status"] = self.result["status_before"] = status
        self.record_diff(current, updates, deletes, grow)
        if not (updates or deletes or grow):
            if status == "running":  # left pending by an earlier run or by hand
                self.handle_pending(ct, [])
            return
        self.result.update(changed=True, updates=updates, deletes=deletes, disk_grown_to_gb=grow)
        predicted = cfgmod.needs_restart(updates, deletes) if status == "running" else []
        if self.check:
            if predicted:
                self.result["pending"] = predicted
                self.result["messages"].append(f"would reboot container {self.vmid} to apply: {', '.join(predicted)}")
            return
        self.apply_update(ct, current, updates, deletes, grow)
        if status == "running":
            self.handle_pending(ct, predicted)

    def check_same_hostname(self, current):
        """A vmid that holds another hostname is someone else's container: refuse before changing it."""
        have_name = current.get("hostname")
        if have_name != self.p["hostname"]:
            raise PveError(f"vmid {self.vmid} is already used by container {have_name!r} on node "
                           f"{self.pve.node}, not {self.p['hostname']!r}; choose another proxmox_lxc_vmid "
                           f"(nothing was changed)")

    def plan_update(self, current):
        """(config updates, deleted keys, GiB to grow the rootfs to or None); refuses create-only changes."""
        updates, deletes, conflicts = cfgmod.diff_config(self.desired, current)
        if conflicts:
            raise PveError(f"container {self.vmid}: " + "; ".join(conflicts))
        grow = cfgmod.rootfs_plan(self.p["disk_gb"], current.get("rootfs"))
        self.check_device_rights([k for k in list(updates) + deletes if cfgmod.family(k) == "dev"])
        return updates, deletes, grow

    def record_diff(self, current, updates, deletes, grow):
        after = cfgmod.apply_changes(current, updates, deletes)
        if grow:
            after["rootfs"] = _with_size(current["rootfs"], grow)
        self.diff_before, self.diff_after = cfgmod.render_config(current), cfgmod.render_config(after)

    def apply_update(self, ct, current, updates, deletes, grow):
        if updates or deletes:
            upid = self.pve.call(f"updating container {self.vmid}", ct.config.put,
                                 **_config_put_body(current, updates, deletes))
            self.pve.wait(upid, f"updating container {self.vmid}")
        if grow:
            upid = self.pve.call(f"growing the disk of {self.vmid}", ct.resize.put, disk="rootfs",
                                 size=f"{_gib(grow)}G")
            self.pve.wait(upid, f"growing the disk of {self.vmid}")

    def handle_pending(self, ct, predicted):
        try:
            pending = [e["key"] for e in ct.pending.get() if "pending" in e or e.get("delete")]
        except ResourceException:  # a host without the pending endpoint: fall back on what PVE can't hotplug
            pending = predicted
        self.result["pending"] = pending
        if not pending:
            return
        if self.check:
            if self.p["reboot_for_pending"]:
                self.result["changed"] = True
                self.result["messages"].append(f"would reboot container {self.vmid} to apply pending: "
                                               f"{', '.join(pending)}")
            return
        if self.p["reboot_for_pending"]:
            self.reboot(f"apply pending changes: {', '.join(pending)}")
            self.result["pending"] = []
        else:
            self.m.warn(f"container {self.vmid} has pending changes ({', '.join(pending)}) that apply at its "
                        f"next reboot (reboot_for_pending is off)")

    # ---- power state --------------------------------------------------------------------------------
    def reboot(self, why):
        self.result.update(changed=True, rebooted=True)
        self.result["messages"].append(f"rebooting container {self.vmid} to {why}")
        if self.check:
            return
        upid = self.pve.call(f"rebooting container {self.vmid}", self.pve.lxc(self.vmid).status.reboot.post)
        self.pve.wait(upid, f"rebooting container {self.vmid}")

    def converge_state(self):
        state = self.p["state"]
        if state == "present":
            return
        status = self.result["status"]
        ct = self.pve.lxc(self.vmid)
        if state in ("started", "restarted") and status != "running":
            self.result["changed"] = True
            if not self.check:
                upid = self.pve.call(f"starting container {self.vmid}", ct.status.start.post)
                self.pve.wait(upid, f"starting container {self.vmid}")
            self.result["status"] = "running"
        elif state == "restarted" and not self.result["rebooted"]:
            self.reboot("restart it as asked (state=restarted)")
        elif state == "stopped" and status == "running":
            self.result["changed"] = True
            if not self.check:
                upid = self.pve.call(f"shutting down container {self.vmid}", ct.status.shutdown.post,
                                     timeout=60, forceStop=1)
                self.pve.wait(upid, f"shutting down container {self.vmid}")
            self.result["status"] = "stopped"

    def run(self):
        self.validate_offline()
        self.validate_online()
        if self.guest is None:
            self.create()
        else:
            self.update()
        self.converge_state()
        if self.m._diff:
            self.result["diff"] = {"before": self.diff_before, "after": self.diff_after,
                                       "before_header": f"lxc/{self.vmid}.conf", "after_header": f"lxc/{self.vmid}.conf"}
        return self.result


def _gib(value):
    return int(value) if float(value).is_integer() else value


def _config_put_body(current, updates, deletes):
    """The PUT config body; the digest makes PVE refuse it when someone changed the config meanwhile."""
    body = dict(updates)
    if deletes:
        body["delete"] = ",".join(deletes)
    if current.get("digest"):
        body["digest"] = current["digest"]
    return body


def _with_size(rootfs, gib):
    props = cfgmod.parse_propstring(rootfs, "volume")
    props["size"] = f"{_gib(gib)}G"
    return cfgmod.build_propstring(props, "volume")


def run(module):
    try:
        return Lxc(module).run()
    except cfgmod.ConfigError as exc:  # a bad input, in words: failed like the API's refusals
        raise PveError(str(exc)) from exc


def main():
    run_module(run, OPTIONS)


if __name__ == "__main__":
    main()
