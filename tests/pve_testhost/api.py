"""The PVE REST API subset provisioning uses, as a WSGI app (Werkzeug), with PVE's auth and errors."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from werkzeug.exceptions import HTTPException
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request, Response

from . import pveconf, schema
from .containers import Node, PermError, PveError
from .tasks import Task, TaskManager

PVE_VERSION = {"version": "9.1.1", "release": "9.1", "repoid": "42d4b6d8e3ca4b5e"}
SECRET_PARAMS = {"password"}
TICKET_LIFETIME = 2 * 3600
TEMPLATE_EXT = re.compile(r"^[^/]+\.tar\.(?:gz|xz|zst|bz2)$|^[^/]+\.tgz$")
TEMPLATE_FORMAT = {".tar.gz": "tgz", ".tgz": "tgz", ".tar.xz": "txz", ".tar.zst": "tzst", ".tar.bz2": "tbz2"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, errors: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.errors = status, message, errors


@dataclass
class Credentials:
    root_password: str
    token_id: str  # "root@pam!ci"
    token_secret: str
    ticket_key: bytes


# Routes: every path of the schema, plus the login. Werkzeug syntax; volume ids contain '/'.
def _rule(template: str) -> str:
    return re.sub(r"\{volume\}", "<path:volume>", re.sub(r"\{(\w+)\}", r"<\1>", template))


def build_routes() -> Map:
    rules = [Rule(_rule(t), endpoint=t) for t in schema.endpoints()]
    rules.append(Rule("/access/ticket", endpoint="/access/ticket"))
    return Map(rules, strict_slashes=False, merge_slashes=False)


class PveApi:
    def __init__(self, node: Node, creds: Credentials, tasks: TaskManager, calls_file: Path):
        self.node = node
        self.creds = creds
        self.tasks = tasks
        self.calls_file = calls_file
        self.routes = build_routes()
        self._calls_lock = threading.Lock()
        self.handlers = {
            ("/version", "GET"): self.get_version,
            ("/nodes", "GET"): self.get_nodes,
            ("/cluster/resources", "GET"): self.get_resources,
            ("/cluster/nextid", "GET"): self.get_nextid,
            ("/cluster/tasks", "GET"): self.get_cluster_tasks,
            ("/nodes/{node}/storage", "GET"): self.get_storages,
            ("/nodes/{node}/storage/{storage}/content", "GET"): self.get_content,
            ("/nodes/{node}/storage/{storage}/content/{volume}", "DELETE"): self.delete_content,
            ("/nodes/{node}/storage/{storage}/upload", "POST"): self.upload,
            ("/nodes/{node}/lxc", "GET"): self.list_lxc,
            ("/nodes/{node}/lxc", "POST"): self.create_lxc,
            ("/nodes/{node}/lxc/{vmid}", "GET"): self.lxc_index,
            ("/nodes/{node}/lxc/{vmid}", "DELETE"): self.destroy_lxc,
            ("/nodes/{node}/lxc/{vmid}/config", "GET"): self.get_config,
            ("/nodes/{node}/lxc/{vmid}/config", "PUT"): self.put_config,
            ("/nodes/{node}/lxc/{vmid}/pending", "GET"): self.get_pending,
            ("/nodes/{node}/lxc/{vmid}/status/current", "GET"): self.status_current,
            ("/nodes/{node}/lxc/{vmid}/status/start", "POST"): self.status_start,
            ("/nodes/{node}/lxc/{vmid}/status/stop", "POST"): self.status_stop,
            ("/nodes/{node}/lxc/{vmid}/status/shutdown", "POST"): self.status_shutdown,
            ("/nodes/{node}/lxc/{vmid}/status/reboot", "POST"): self.status_reboot,
            ("/nodes/{node}/tasks", "GET"): self.list_tasks,
            ("/nodes/{node}/tasks/{upid}/status", "GET"): self.task_status,
            ("/nodes/{node}/tasks/{upid}/log", "GET"): self.task_log,
            ("/nodes/{node}/tasks/{upid}", "DELETE"): self.task_stop,
        }

    # --- WSGI ----------------------------------------------------------------------------------------
    def __call__(self, environ, start_response):
        request = Request(environ)
        try:
            response = self.dispatch(request)
        except ApiError as exc:
            body = {"data": None}
            if exc.errors:
                body["errors"] = exc.errors
            response = self.json_response(body, f"{exc.status} {exc.message}")
        return response(environ, start_response)

    @staticmethod
    def json_response(body, status="200 OK") -> Response:
        # The reason phrase carries PVE's message (proxmoxer shows it); keep it on one line.
        status = status.replace("\n", " ").strip()
        return Response(json.dumps(body), status=status, content_type="application/json;charset=UTF-8")

    def dispatch(self, request: Request) -> Response:
        prefix = "/api2/json"
        if not request.path.startswith(prefix + "/"):
            raise ApiError(501, f"Method '{request.method} {request.path}' not implemented")
        path = request.path[len(prefix):]
        adapter = self.routes.bind("pve", path_info=path)
        try:
            template, path_params = adapter.match(path, method=request.method)
        except HTTPException:
            raise ApiError(501, f"Method '{request.method} {prefix}{path}' not implemented") from None
        params = self.request_params(request)
        if template == "/access/ticket":
            if request.method != "POST":
                raise ApiError(501, f"Method '{request.method} {prefix}{path}' not implemented")
            return self.json_response({"data": self.login(params)})
        user, auth = self.authenticate(request)
        self.record(request.method, path, params, auth, request)
        handler = self.handlers.get((template, request.method))
        if handler is None:
            raise ApiError(501, f"Method '{request.method} {prefix}{path}' not implemented")
        if template.endswith("/upload") and "filename" in request.files:
            params["filename"] = request.files["filename"].filename or ""
        all_params = {**params, **{k: unquote(v) for k, v in path_params.items()}}
        try:
            typed = schema.validate(template, request.method, all_params)
        except schema.ParamError as exc:
            raise ApiError(400, "Parameter verification failed.", exc.errors) from None
        if "node" in typed and typed["node"] != self.node.name:
            raise ApiError(595, f"no such node '{typed['node']}'")
        try:
            data = handler(typed, user=user, request=request)
        except PermError as exc:
            raise ApiError(403, f"Permission check failed ({exc})") from None
        except PveError as exc:
            raise ApiError(500, str(exc)) from None
        return self.json_response({"data": data})

    @staticmethod
    def request_params(request: Request) -> dict[str, str]:
        params = {k: v for k, v in request.args.items()}
        if request.mimetype == "application/json":
            body = request.get_json(silent=True) or {}
            if not isinstance(body, dict):
                raise ApiError(400, "Parameter verification failed.", {"body": "expected a JSON object"})
            for k, v in body.items():
                params[k] = str(int(v)) if isinstance(v, bool) else str(v)
        else:
            params.update({k: v for k, v in request.form.items()})
        return params

    def record(self, method: str, path: str, params: dict, auth: str, request: Request) -> None:
        safe = {k: ("<redacted>" if k in SECRET_PARAMS else v) for k, v in params.items()}
        if "filename" in request.files:
            safe["filename"] = request.files["filename"].filename
        line = json.dumps({"method": method, "path": path, "params": safe, "auth": auth})
        with self._calls_lock, open(self.calls_file, "a") as fh:
            fh.write(line + "\n")

    # --- auth ----------------------------------------------------------------------------------------
    def _sign(self, text: str) -> str:
        return hmac.new(self.creds.ticket_key, text.encode(), hashlib.sha256).hexdigest()

    def make_ticket(self, user: str) -> tuple[str, str]:
        now = f"{int(time.time()):08X}"
        plain = f"PVE:{user}:{now}"
        csrf_plain = f"{now}:{user}"
        return f"{plain}::{self._sign(plain)}", f"{now}:{self._sign('csrf:' + csrf_plain)}"

    def check_ticket(self, ticket: str) -> str | None:
        m = re.fullmatch(r"(PVE:([^:]+):([0-9A-F]{8}))::([0-9a-f]{64})", ticket or "")
        if not m or not hmac.compare_digest(self._sign(m[1]), m[4]):
            return None
        if time.time() - int(m[3], 16) > TICKET_LIFETIME:
            return None
        return m[2]

    def check_csrf(self, token: str, user: str) -> bool:
        m = re.fullmatch(r"([0-9A-F]{8}):([0-9a-f]{64})", token or "")
        return bool(m) and hmac.compare_digest(self._sign(f"csrf:{m[1]}:{user}"), m[2])

    def login(self, params: dict[str, str]) -> dict | None:
        username = params.get("username", "")
        if "@" not in username and params.get("realm"):
            username = f"{username}@{params['realm']}"
        password = params.get("password", "")
        ok = username == "root@pam" and (
            hmac.compare_digest(password.encode(), self.creds.root_password.encode())
            or self.check_ticket(password) == "root@pam")
        if not ok:
            raise ApiError(401, "authentication failure")
        ticket, csrf = self.make_ticket(username)
        return {"username": username, "ticket": ticket, "CSRFPreventionToken": csrf,
                "cap": {"vms": {}, "storage": {}, "nodes": {}, "access": {}, "dc": {}}}

    def authenticate(self, request: Request) -> tuple[str, str]:
        header = request.headers.get("Authorization", "")
        if header.startswith("PVEAPIToken"):
            m = re.fullmatch(r"PVEAPIToken[=\s]([^=:]+)[=:](.+)", header.strip())
            if not m or m[1] != self.creds.token_id or not hmac.compare_digest(
                    m[2].encode(), self.creds.token_secret.encode()):
                raise ApiError(401, "invalid token value!")
            return m[1], "token"
        ticket = request.cookies.get("PVEAuthCookie")
        if ticket is None:
            raise ApiError(401, "No ticket")
        user = self.check_ticket(unquote(ticket))
        if user is None:
            raise ApiError(401, "invalid ticket")
        if request.method != "GET" and not self.check_csrf(request.headers.get("CSRFPreventionToken", ""), user):
            raise ApiError(401, "Permission denied - invalid csrf token")
        return user, "ticket"

    # --- helpers -------------------------------------------------------------------------------------
    def _need_ct(self, vmid: int) -> pveconf.CtConfig:
        return self.node.read(vmid)

    def _check_storage(self, storage: str) -> None:
        if storage != self.node.storage_id:
            raise PveError(f"storage '{storage}' does not exist")

    def typed_config(self, values: dict[str, str]) -> dict:
        props = schema.method_schema("/nodes/{node}/lxc", "POST")["parameters"]["properties"]
        out = {}
        for k, v in values.items():
            sch = schema.property_schema(props, k) or {}
            try:
                out[k] = schema.check_value({"type": sch.get("type", "string")}, v) \
                    if sch.get("type") in ("integer", "boolean", "number") else v
            except ValueError:
                out[k] = v
            if isinstance(out[k], float) and out[k].is_integer():
                out[k] = int(out[k])
        return out

    # --- cluster / node ------------------------------------------------------------------------------
    def get_version(self, p, **_):
        return dict(PVE_VERSION)

    def node_entry(self) -> dict:
        mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return {"node": self.node.name, "status": "online", "type": "node", "id": f"node/{self.node.name}",
                "cpu": os.getloadavg()[0] / (os.cpu_count() or 1), "maxcpu": os.cpu_count() or 1,
                "mem": 0, "maxmem": mem_total, "disk": 0, "maxdisk": shutil.disk_usage("/").total,
                "uptime": int(time.monotonic()), "level": "", "ssl_fingerprint": ""}

    def get_nodes(self, p, **_):
        return [self.node_entry()]

    def ct_resource(self, vmid: int) -> dict:
        st = self.node.status_current(vmid)
        return {"id": f"lxc/{vmid}", "type": "lxc", "vmid": vmid, "node": self.node.name,
                "name": st["name"], "status": st["status"], "maxmem": st["maxmem"], "maxdisk": st["maxdisk"],
                "maxcpu": st["cpus"], "cpu": 0, "mem": 0, "disk": 0, "uptime": st["uptime"],
                "template": st["template"], "netin": 0, "netout": 0, "diskread": 0, "diskwrite": 0,
                **({"tags": st["tags"]} if "tags" in st else {}), **({"lock": st["lock"]} if "lock" in st else {})}

    def storage_entry(self) -> dict:
        du = shutil.disk_usage(self.node.paths.storage)
        return {"storage": self.node.storage_id, "type": "dir", "content": "rootdir,vztmpl",
                "active": 1, "enabled": 1, "shared": 0, "total": du.total, "used": du.used,
                "avail": du.free, "used_fraction": du.used / du.total}

    def get_resources(self, p, **_):
        kind = p.get("type")
        res = []
        if kind in (None, "vm"):
            res += [self.ct_resource(v) for v in self.node.vmids()]
        if kind in (None, "node"):
            res.append(self.node_entry())
        if kind in (None, "storage"):
            s = self.storage_entry()
            res.append({"id": f"storage/{self.node.name}/{s['storage']}", "type": "storage",
                        "storage": s["storage"], "node": self.node.name, "status": "available",
                        "content": s["content"], "plugintype": "dir", "shared": 0,
                        "disk": s["used"], "maxdisk": s["total"]})
        return res

    def get_nextid(self, p, **_):
        used = set(self.node.vmids())
        if "vmid" in p:
            if p["vmid"] in used:
                raise ApiError(400, "Parameter verification failed.", {"vmid": f"VM {p['vmid']} already exists"})
            return str(p["vmid"])
        vmid = 100
        while vmid in used:
            vmid += 1
        return str(vmid)  # PVE returns the id as a string

    # --- storage -------------------------------------------------------------------------------------
    def get_storages(self, p, **_):
        return [self.storage_entry()]

    def get_content(self, p, **_):
        self._check_storage(p["storage"])
        wanted = set(p["content"].split(",")) if p.get("content") else None
        items = []
        if wanted is None or "vztmpl" in wanted:
            for f in sorted(self.node.paths.template_dir().iterdir()):
                if f.is_file() and TEMPLATE_EXT.match(f.name):
                    ext = next(e for e in TEMPLATE_FORMAT if f.name.endswith(e))
                    items.append({"volid": f"{self.node.storage_id}:vztmpl/{f.name}", "content": "vztmpl",
                                  "format": TEMPLATE_FORMAT[ext], "size": f.stat().st_size,
                                  "ctime": int(f.stat().st_mtime)})
        if wanted is None or "rootdir" in wanted:
            for d in sorted((self.node.paths.storage / "images").glob("*/vm-*-disk-*")):
                vmid = int(d.parent.name)
                if "vmid" in p and p["vmid"] != vmid:
                    continue
                items.append({"volid": f"{self.node.storage_id}:{vmid}/{d.name}", "content": "rootdir",
                              "format": "raw", "vmid": vmid, "size": 0, "ctime": int(d.stat().st_mtime)})
        return items

    def delete_content(self, p, user, **_):
        self._check_storage(p["storage"])
        volid = p["volume"] if ":" in p["volume"] else f"{p['storage']}:{p['volume']}"
        path = self.node.template_path(volid)

        def work(task: Task):
            task.log(f"Removed volume '{volid}'")
            path.unlink()

        return self.tasks.start("imgdel", volid, user, work)

    def upload(self, p, user, request: Request, **_):
        self._check_storage(p["storage"])
        if p["content"] != "vztmpl":
            raise ApiError(400, "Parameter verification failed.",
                           {"content": f"storage '{p['storage']}' does not support content type '{p['content']}'"})
        fileobj = request.files.get("filename")
        if fileobj is None:
            raise ApiError(400, "Parameter verification failed.", {"filename": "missing file upload"})
        name = p["filename"]
        if not TEMPLATE_EXT.match(name):
            raise ApiError(400, "Parameter verification failed.", {"filename": "wrong file extension"})
        tmp = Path("/var/tmp") / f"pveupload-{secrets.token_hex(16)}"
        fileobj.save(str(tmp))
        target = self.node.paths.template_dir() / name

        def work(task: Task):
            try:
                task.log(f"starting file import from: {tmp}")
                if p.get("checksum"):
                    h = hashlib.new(p["checksum-algorithm"])
                    with open(tmp, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 20), b""):
                            h.update(chunk)
                    task.log(f"calculating checksum of '{tmp}'...")
                    if h.hexdigest() != p["checksum"].lower():
                        raise RuntimeError(f"checksum mismatch: got '{h.hexdigest()}' != expected "
                                           f"'{p['checksum'].lower()}'")
                    task.log("checksum verified")
                task.log(f"target node: {self.node.name}")
                task.log(f"target file: {target}")
                task.log(f"file size is: {tmp.stat().st_size}")
                task.log(f"command: cp -- {tmp} {target}")
                shutil.copyfile(tmp, target)
                task.log("finished file import successfully")
            finally:
                tmp.unlink(missing_ok=True)

        return self.tasks.start("imgcopy", "", user, work)

    # --- containers ----------------------------------------------------------------------------------
    def list_lxc(self, p, **_):
        out = []
        for vmid in self.node.vmids():
            st = self.node.status_current(vmid)
            out.append({k: st[k] for k in ("vmid", "name", "status", "type", "maxmem", "maxswap", "cpus",
                                           "uptime", "cpu", "mem", "disk", "maxdisk", "netin", "netout")
                        } | ({"lock": st["lock"]} if "lock" in st else {}) | ({"tags": st["tags"]} if "tags" in st else {}))
        return out

    def lxc_index(self, p, **_):
        self._need_ct(p["vmid"])
        return [{"subdir": s} for s in ("config", "status", "vncproxy", "termproxy", "vncwebsocket", "spiceproxy",
                                        "migrate", "clone", "snapshot", "firewall", "rrd", "rrddata",
                                        "pending", "feature", "template", "resize", "move_volume", "interfaces")]

    def create_lxc(self, p, user, **_):
        vmid = p["vmid"]
        self.node.template_path(p["ostemplate"])
        if p.get("storage", "local") != self.node.storage_id:
            raise PveError(f"storage '{p['storage']}' does not exist")
        unpriv = bool(p.get("unprivileged", 1))
        conf_keys = {k: str(v) for k, v in p.items() if k not in ("node", "vmid", "ostemplate", "password",
                                                                  "ssh-public-keys", "start", "storage")}
        self.node.check_modify_perm(user, None, conf_keys, [], unpriv)
        for k, v in conf_keys.items():
            if re.fullmatch(r"dev\d+", k):
                self.node.check_dev(v)
        with self.node.locked(vmid):
            if self.node.exists(vmid):
                if not p.get("force"):
                    raise PveError(f"CT {vmid} already exists on node '{self.node.name}'")
                if self.node.status(vmid) == "running":
                    raise PveError(f"unable to restore CT {vmid} - CT is running")
            # Reserve the id the way PVE does: a config with 'lock: create' until the task ends.
            pveconf.write(self.node.paths.conf(vmid), pveconf.CtConfig(values={"lock": "create"}))

        def work(task: Task):
            self.node.create(vmid, p, user, task.log)
            if p.get("start"):
                self.node.start(vmid, task.log)

        def undo():  # a failed create leaves no CT behind (a failed start after it does)
            conf = self.node.paths.conf(vmid)
            if conf.exists() and pveconf.read(conf).values.get("lock") == "create":
                conf.unlink()
                shutil.rmtree(self.node.paths.images(vmid), ignore_errors=True)

        return self.tasks.start("vzcreate", str(vmid), user, work, on_error=undo)

    def destroy_lxc(self, p, user, **_):
        vmid = p["vmid"]
        conf = self._need_ct(vmid)
        if self.node.status(vmid) == "running" and not p.get("force"):
            raise PveError(f"unable to destroy CT {vmid} - container is running")
        if conf.values.get("lock"):
            raise PveError(f"CT is locked ({conf.values['lock']})")
        return self.tasks.start("vzdestroy", str(vmid), user,
                                lambda t: self.node.destroy(vmid, t.log, force=bool(p.get("force"))))

    def get_config(self, p, **_):
        conf = self._need_ct(p["vmid"])
        values = dict(conf.values)
        if not p.get("current"):
            for k in conf.pending_delete:
                values.pop(k, None)
            values.update(conf.pending)
        out = self.typed_config(values)
        if conf.description:
            out["description"] = conf.description + "\n"
        if conf.lxc:
            out["lxc"] = [[k, v] for k, v in conf.lxc]
        out["digest"] = conf.digest
        return out

    def put_config(self, p, user, **_):
        vmid = p["vmid"]
        self._need_ct(vmid)
        new = {k: str(v) for k, v in p.items() if k not in ("node", "vmid", "delete", "digest", "revert")}
        delete = [k for k in re.split(r"[,;\s]+", str(p.get("delete", ""))) if k]
        revert = [k for k in re.split(r"[,;\s]+", str(p.get("revert", ""))) if k]
        props = schema.method_schema("/nodes/{node}/lxc/{vmid}/config", "PUT")["parameters"]["properties"]
        bad = {k: "property is not defined in schema" for k in delete + revert if schema.property_schema(props, k) is None}
        both = {k: f"conflicting set/delete for '{k}'" for k in delete if k in new}
        if bad or both:
            raise ApiError(400, "Parameter verification failed.", {**bad, **both})
        self.node.update_config(vmid, new, delete, user, p.get("digest"), revert)

    def get_pending(self, p, **_):
        conf = self._need_ct(p["vmid"])
        out = []
        typed = self.typed_config(conf.values)
        ptyped = self.typed_config(conf.pending)
        for k in sorted(set(conf.values) | set(conf.pending) | set(conf.pending_delete)):
            item = {"key": k}
            if k in conf.values:
                item["value"] = typed[k]
            if k in conf.pending:
                item["pending"] = ptyped[k]
            if k in conf.pending_delete:
                item["delete"] = 1
            out.append(item)
        for k, v in conf.lxc:
            out.append({"key": k, "value": v})
        return out

    def status_current(self, p, **_):
        return self.node.status_current(p["vmid"])

    def _need_running(self, vmid: int, running: bool) -> None:
        conf = self._need_ct(vmid)
        is_running = self.node.status(vmid) == "running"
        if running and not is_running:
            raise PveError(f"CT {vmid} not running")
        if not running and is_running:
            raise PveError(f"CT {vmid} already running")
        if conf.values.get("lock") and conf.values["lock"] != "mounted":
            raise PveError(f"CT is locked ({conf.values['lock']})")

    def status_start(self, p, user, **_):
        vmid = p["vmid"]
        self._need_running(vmid, False)
        return self.tasks.start("vzstart", str(vmid), user, lambda t: self.node.start(vmid, t.log))

    def status_stop(self, p, user, **_):
        vmid = p["vmid"]
        self._need_running(vmid, True)
        return self.tasks.start("vzstop", str(vmid), user, lambda t: self.node.stop(vmid, t.log))

    def status_shutdown(self, p, user, **_):
        vmid = p["vmid"]
        self._need_running(vmid, True)
        timeout = p.get("timeout", 60)
        return self.tasks.start("vzshutdown", str(vmid), user, lambda t: self.node.stop(
            vmid, t.log, timeout=timeout, force=bool(p.get("forceStop"))))

    def status_reboot(self, p, user, **_):
        vmid = p["vmid"]
        self._need_running(vmid, True)

        def work(task: Task):
            self.node.stop(vmid, task.log, timeout=p.get("timeout", 60), force=True)
            self.node.start(vmid, task.log)

        return self.tasks.start("vzreboot", str(vmid), user, work)

    # --- tasks ---------------------------------------------------------------------------------------
    def _task(self, p) -> Task:
        task = self.tasks.get(p["upid"])
        if task is None:
            raise PveError("no such task")
        return task

    def list_tasks(self, p, **_):
        out = []
        for t in self.tasks.list():
            if "vmid" in p and t.id != str(p["vmid"]):
                continue
            if p.get("typefilter") and t.type != p["typefilter"]:
                continue
            if p.get("errors") and t.exitstatus in (None, "OK"):
                continue
            d = t.status_dict()
            if t.endtime:
                d["endtime"] = t.endtime
            d["status"] = t.exitstatus if t.status == "stopped" else "running"
            out.append(d)
        start = p.get("start", 0)
        return out[start:start + p.get("limit", 50)]

    def get_cluster_tasks(self, p, **_):
        return self.list_tasks({}, )

    def task_status(self, p, **_):
        return self._task(p).status_dict()

    def task_log(self, p, **_):
        task = self._task(p)
        start, limit = p.get("start", 0), p.get("limit", 50)
        lines = list(task.lines)
        return [{"n": i + 1, "t": t} for i, t in enumerate(lines)][start:start + limit if limit else None]

    def task_stop(self, p, **_):
        self._task(p)
