"""The PVE REST API subset provisioning uses, as a WSGI app (Werkzeug), with PVE's auth and errors.

Request handling follows pve-http-server (src/PVE/APIServer/AnyEvent.pm, Formatter/Standard.pm) and
pve-manager (PVE/HTTPServer.pm auth_handler, rest_handler); the handlers follow pve-container,
pve-storage and pve-manager's API2 modules, as each docstring names.
"""

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
from werkzeug.http import HTTP_STATUS_CODES
from werkzeug.routing import Map, Rule
from werkzeug.wrappers import Request, Response

from . import pveconf, schema
from .containers import TEMPLATE_FILE_RE, Node, PermError, PveError
from .tasks import Task, TaskManager, parse_upid

PVE_VERSION = {"version": "9.1.1", "release": "9.1", "repoid": "42d4b6d8e3ca4b5e"}
SECRET_PARAMS = {"password"}
TICKET_LIFETIME = 2 * 3600


class ApiError(Exception):
    """An error answer. message is PVE's text (most end in a newline, as PVE's `die "...\n"` do);
    body=False: no body at all, as pve-http-server answers a failed authentication."""

    def __init__(self, status: int, message: str, errors: dict | None = None, body: bool = True):
        super().__init__(message)
        self.status, self.message, self.errors, self.body = status, message, errors, body


@dataclass
class WithTotal:
    """A result plus the 'total' attribute PVE adds beside 'data' (rpcenv->set_result_attrib)."""
    data: object
    total: int


def param_error(errors: dict) -> ApiError:
    return ApiError(400, "Parameter verification failed.\n", errors)


@dataclass
class Credentials:
    root_password: str
    token_id: str  # "root@pam!ci"
    token_secret: str
    ticket_key: bytes


# Routes: every path of the schema. Werkzeug syntax; a volume id is the rest of the path, '/' and all,
# as pve-storage registers the content subclass with fragmentDelimiter '' (API2/Storage/Status.pm).
def _rule(template: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: "<path:volume>" if m[1] == "volume" else f"<{m[1]}>", template)


def build_routes() -> Map:
    return Map([Rule(_rule(t), endpoint=t) for t in schema.endpoints()], strict_slashes=False, merge_slashes=False)


def auth_value(header: str, key: str) -> str | None:
    """pve-http-server Formatter.pm extract_auth_value: 'KEY=value' or 'KEY value' up to a ';'."""
    m = re.search(rf"(?:^|\s){re.escape(key)}(?:=| )([^;]*)", header or "")
    return unquote(m[1]) if m and m[1] else None


def unknown_node_message(node: str) -> str:
    """What resolving a node that is not in the cluster dies with (pve-cluster Cluster.pm
    remote_node_ip -> pve-common Network.pm get_ip_from_hostname -> Tools.pm getaddrinfo_all)."""
    return f"hostname lookup '{node}' failed - failed to get address info for: {node}: Name or service not known\n"


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
            response = self.error_response(exc)
        return response(environ, start_response)

    @staticmethod
    def status_line(status: int, message: str) -> str:
        # AnyEvent.pm response(): the reason phrase is the message's first line.
        reason = message.split("\n", 1)[0].replace("\r", " ").strip() or HTTP_STATUS_CODES.get(status, "")
        return f"{status} {reason}"

    def error_response(self, exc: ApiError) -> Response:
        if not exc.body:  # a failed login check: status line only, no body
            return Response(b"", status=self.status_line(exc.status, exc.message))
        # Formatter/Standard.pm prepare_response_data: data, errors, and (pve-http-server >= 5.2) the
        # message, newline included.
        body = {"data": None}
        if exc.errors:
            body["errors"] = exc.errors
        body["message"] = exc.message or HTTP_STATUS_CODES.get(exc.status, "")
        return self.json_response(body, self.status_line(exc.status, exc.message))

    @staticmethod
    def json_response(body, status="200 OK") -> Response:
        return Response(json.dumps(body), status=status, content_type="application/json;charset=UTF-8")

    def dispatch(self, request: Request) -> Response:
        prefix = "/api2/json"
        if not request.path.startswith(prefix + "/"):
            raise ApiError(501, "no such uri")
        # PVE routes on the URI's non-empty fragments (RESTHandler::find_handler), '%2F' decoded.
        path = "/" + "/".join(part for part in request.path[len(prefix):].split("/") if part)
        params = self.request_params(request)
        if path == "/access/ticket" and request.method in ("GET", "POST"):  # the one call without login
            if request.method == "GET":
                return self.json_response({"data": None})
            return self.json_response({"data": self.login(params)})
        user, auth = self.authenticate(request)
        self.record(request.method, path, params, auth, request)
        template, path_params, handler = self.find_handler(path, request.method)
        if template.endswith("/upload") and "filename" in request.files:
            params["filename"] = request.files["filename"].filename or ""
        typed = self.checked_params(template, request.method, params, path_params)
        try:
            data = handler(typed, user=user, request=request)
        except PermError as exc:
            raise ApiError(403, f"Permission check failed ({exc})\n") from None
        except PveError as exc:
            raise ApiError(500, f"{exc}\n") from None
        if isinstance(data, WithTotal):
            return self.json_response({"data": data.data, **({"total": data.total} if data.total else {})})
        return self.json_response({"data": data})

    def find_handler(self, path: str, method: str) -> tuple[str, dict[str, str], object]:
        """(schema path template, the values of its {placeholders}, the handler) of a call; 501 if none."""
        not_implemented = ApiError(501, f"Method '{method} {path}' not implemented")
        try:
            template, path_params = self.routes.bind("pve", path_info=path).match(path, method=method)
        except HTTPException:
            raise not_implemented from None
        handler = self.handlers.get((template, method))
        if handler is None:
            raise not_implemented
        return template, path_params, handler

    def checked_params(self, template: str, method: str, params: dict[str, str],
                       path_params: dict[str, str]) -> dict:
        """The call's parameters, typed, after rest_handler's checks: URI clashes, the node, the schema."""
        conflicts = {k: "duplicate parameter (already defined in URI) with conflicting values!"
                     for k in params if k in path_params and params[k] != path_params[k]}
        if conflicts:
            raise param_error(conflicts)
        # rest_handler proxies to the node before the handler validates anything
        node = path_params.get("node")
        if schema.method_schema(template, method).get("proxyto") == "node" and node not in (
                self.node.name, "localhost"):
            raise ApiError(500, unknown_node_message(node))
        try:
            return schema.validate(template, method, {**params, **path_params})
        except schema.ParamError as exc:
            raise param_error(exc.errors) from None

    @staticmethod
    def request_params(request: Request) -> dict[str, str]:
        """AnyEvent.pm extract_params: the body (form or JSON) of a PUT/POST, then the query string over it."""
        params: dict[str, str] = {}
        if request.method in ("PUT", "POST"):
            if request.mimetype == "application/json":
                body = request.get_json(silent=True) or {}
                if not isinstance(body, dict):
                    raise param_error({"body": "expected a JSON object"})
                for k, v in body.items():  # JSON true/false pass PVE's boolean check as 1/0
                    params[k] = str(int(v)) if isinstance(v, bool) else str(v)
            else:
                params.update({k: v for k, v in request.form.items()})
        params.update({k: v for k, v in request.args.items()})
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
        if not ok:  # pve-access-control API2/AccessControl.pm create_ticket
            raise ApiError(401, "authentication failure\n")
        ticket, csrf = self.make_ticket(username)
        return {"username": username, "ticket": ticket, "CSRFPreventionToken": csrf,
                "cap": {"vms": {}, "storage": {}, "nodes": {}, "access": {}, "dc": {}}}

    def authenticate(self, request: Request) -> tuple[str, str]:
        """pve-manager PVE/HTTPServer.pm auth_handler: a ticket (cookie, or the Authorization header),
        else an API token. Every failure is a 401 whose reason is the die text and which has no body
        (AnyEvent.pm authenticate_and_handle_request); PVE also delays it by 3 s, we do not."""
        header = request.headers.get("Authorization", "")
        ticket = request.cookies.get("PVEAuthCookie") or auth_value(header, "PVEAuthCookie")
        token = None if ticket else auth_value(header, "PVEAPIToken")
        if token is not None:
            # AccessControl.pm verify_token: "<user>@<realm>!<name>=<secret>"; any failure reads
            # "Authentication failed!" (the reason is only logged)
            tokenid, sep, secret = token.rpartition("=")
            if not sep or tokenid != self.creds.token_id or not hmac.compare_digest(
                    secret.encode(), self.creds.token_secret.encode()):
                raise ApiError(401, "Authentication failed!\n", body=False)
            return tokenid, "token"
        if not ticket:
            raise ApiError(401, "No ticket\n", body=False)
        user = self.check_ticket(unquote(ticket))
        if user is None:
            raise ApiError(401, "Authentication failed!\n", body=False)
        is_upload = request.method == "POST" and re.fullmatch(r"/api2/json/nodes/[^/]+/storage/[^/]+/upload",
                                                              request.path)
        if request.method != "GET" and not is_upload and not self.check_csrf(
                request.headers.get("CSRFPreventionToken", ""), user):  # uploads skip CSRF (native forms)
            raise ApiError(401, "Permission denied - invalid csrf token\n", body=False)
        return user, "ticket"

    # --- helpers -------------------------------------------------------------------------------------
    def _need_ct(self, vmid: int) -> pveconf.CtConfig:
        return self.node.read(vmid)

    def _check_storage(self, storage: str) -> None:
        if storage != self.node.storage_id:
            raise PveError(f"storage '{storage}' does not exist")

    @staticmethod
    def typed_config(values: dict[str, str]) -> dict:
        """Config values as parse_pct_config types them (LXC/Config.pm check_type): integers and
        booleans become numbers, everything else (numbers like cpulimit too) stays a string."""
        props = schema.method_schema("/nodes/{node}/lxc", "POST")["parameters"]["properties"]
        out = {}
        for k, v in values.items():
            sch = schema.property_schema(props, k) or {}
            typ = sch.get("type")
            if typ == "integer" and re.fullmatch(r"\d+", v):
                out[k] = int(v)
            elif typ == "boolean" and re.fullmatch(r"(?i:1|0|on|off|yes|no|true|false)", v):
                out[k] = 1 if re.fullmatch(r"(?i:1|on|yes|true)", v) else 0
            else:
                out[k] = v
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
        """A guest of GET /cluster/resources (pve-manager API2Tools.pm extract_vm_stats)."""
        st = self.node.status_current(vmid)
        return {"id": f"lxc/{vmid}", "type": "lxc", "vmid": vmid, "node": self.node.name,
                "name": st["name"], "status": st["status"], "maxmem": st["maxmem"], "maxdisk": st["maxdisk"],
                "maxcpu": st["cpus"], "cpu": st["cpu"], "mem": st["mem"], "disk": st["disk"],
                "uptime": st["uptime"], "template": st.get("template", 0), "netin": 0, "netout": 0,
                "diskread": 0, "diskwrite": 0,
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
        """pve-manager API2/Cluster.pm nextid: a string on the wire (JSON::XS sees the stringified id)."""
        used = set(self.node.vmids())
        if "vmid" in p:
            if p["vmid"] in used:
                raise param_error({"vmid": f"VM {p['vmid']} already exists"})
            return str(p["vmid"])
        vmid = 100
        while vmid in used:
            vmid += 1
        return str(vmid)

    # --- storage -------------------------------------------------------------------------------------
    def get_storages(self, p, **_):
        return [self.storage_entry()]

    def get_content(self, p, **_):
        """pve-storage API2/Storage/Content.pm index -> Plugin.pm list_volumes / get_subdir_files."""
        self._check_storage(p["storage"])
        wanted = set(p["content"].split(",")) if p.get("content") else None
        items = []
        if (wanted is None or "vztmpl" in wanted) and "vmid" not in p:  # templates belong to no vmid
            for f in sorted(self.node.paths.template_dir().iterdir()):
                m = TEMPLATE_FILE_RE.fullmatch(f.name)
                if f.is_file() and m:
                    st = f.stat()
                    items.append({"volid": f"{self.node.storage_id}:vztmpl/{f.name}", "content": "vztmpl",
                                  "format": "tar" if m[1] else f"t{m[2]}", "size": st.st_size,
                                  "ctime": int(st.st_ctime)})
        if wanted is None or "rootdir" in wanted:
            for d in sorted((self.node.paths.storage / "images").glob("*/vm-*-disk-*")):
                vmid = int(d.parent.name)
                if "vmid" in p and p["vmid"] != vmid:
                    continue
                items.append({"volid": f"{self.node.storage_id}:{vmid}/{d.name}", "content": "rootdir",
                              "format": "raw", "vmid": vmid, "size": 0, "ctime": int(d.stat().st_ctime)})
        return items

    def delete_content(self, p, user, **_):
        """pve-storage API2/Storage/Content.pm delete: an 'imgdel' task, id '<storage>' (or
        '<owner vmid>@<storage>'), that removes the volume; with delay, null when it ended in time."""
        volid, storage = real_volume_id(p.get("storage"), p["volume"])
        vtype, _ = self.node.volume_type(volid)
        volname = volid.partition(":")[2]
        owner = volname.split("/", 1)[0] if vtype == "images" else None
        path = self.node.paths.template_dir() / volname.removeprefix("vztmpl/") if vtype == "vztmpl" \
            else self.node.paths.storage / volname

        def work(task: Task):  # Storage.pm vdisk_free -> Plugin.pm free_image
            if path.is_dir() and vtype == "images":  # the test host's disks are directories
                shutil.rmtree(path)
            elif path.is_file() or path.is_symlink():
                path.unlink()
            else:
                task.log(f"disk image '{path}' does not exist")
            task.log(f"Removed volume '{volid}'")

        upid = self.tasks.start("imgdel", f"{owner}@{storage}" if owner else storage, user, work)
        return self.upid_unless_done(upid, p["delay"]) if p.get("delay") else upid

    def upid_unless_done(self, upid: str, delay: int) -> str | None:
        """Wait up to delay seconds: None when the task ended well, its error when it failed, else its upid."""
        task = self.tasks.wait(upid, timeout=delay)
        if task.status != "stopped":
            return upid
        if task.exitstatus == "OK" or task.exitstatus.startswith("WARNINGS"):
            return None
        raise PveError(task.exitstatus)

    def upload(self, p, user, request: Request, **_):
        """pve-storage API2/Storage/Status.pm upload: checks, then an 'imgcopy' task that copies the file."""
        if p["node"] not in (self.node.name, "localhost"):  # upload has no proxyto; it scp's to the node
            raise PveError(unknown_node_message(p["node"]).rstrip("\n"))
        self._check_storage(p["storage"])
        fileobj = request.files.get("filename")
        if fileobj is None:
            raise PveError("missing temporary file name")
        # Storage.pm normalize_content_filename
        name = re.sub(r"[^a-zA-Z0-9_.-]", "_", re.sub(r"^.*[/\\]", "", p["filename"].rstrip("\n")))
        content = p["content"]
        ext_ok = {"iso": r"[^/]+\.(?i:iso|img)", "vztmpl": TEMPLATE_FILE_RE.pattern,
                  "import": r"[a-zA-Z0-9\-.+=_]+\.(?:ova|qcow2|raw|vmdk)"}
        if content not in ext_ok:
            raise param_error({"content": f"upload content type '{content}' not allowed"})
        if not re.fullmatch(ext_ok[content], name):
            raise param_error({"filename": "invalid filename or wrong extension" if content == "import"
                               else "wrong file extension"})
        if content not in self.storage_entry()["content"].split(","):
            raise PveError(f"storage '{p['storage']}' does not support '{content}' content")
        tmp = Path("/var/tmp") / f"pveupload-{secrets.token_hex(16)}"
        fileobj.save(str(tmp))
        size = tmp.stat().st_size
        target = self.node.paths.template_dir() / name

        def work(task: Task):
            try:
                task.log(f"starting file import from: {tmp}")
                if p.get("checksum-algorithm"):
                    h = hashlib.new(p["checksum-algorithm"])
                    with open(tmp, "rb") as fh:
                        for chunk in iter(lambda: fh.read(1 << 20), b""):
                            h.update(chunk)
                    if h.hexdigest().lower() == p["checksum"].lower():
                        task.log("calculating checksum...OK, checksum verified")  # one line: no newline between
                    else:
                        task.log("calculating checksum...")
                        raise PveError(f"checksum mismatch: got '{h.hexdigest()}' != expect '{p['checksum']}'")
                task.log(f"target node: {self.node.name}")
                task.log(f"target file: {target}")
                task.log(f"file size is: {size}")
                task.log(f"command: cp -- {tmp} {target}")
                shutil.copyfile(tmp, target)
                task.log("finished file import successfully")
            finally:
                tmp.unlink(missing_ok=True)

        return self.tasks.start("imgcopy", "", user, work)

    # --- containers ----------------------------------------------------------------------------------
    def list_lxc(self, p, **_):
        """pve-container API2/LXC.pm vmlist: vmstatus of every CT."""
        return [self.node.status_current(vmid) for vmid in self.node.vmids()]

    def lxc_index(self, p, **_):
        self._need_ct(p["vmid"])
        return [{"subdir": s} for s in ("config", "status", "vncproxy", "termproxy", "vncwebsocket", "spiceproxy",
                                        "migrate", "clone", "snapshot", "firewall", "rrd", "rrddata",
                                        "pending", "feature", "template", "resize", "move_volume", "interfaces")]

    def create_lxc(self, p, user, **_):
        """pve-container API2/LXC.pm create_vm: the checks before the task, then the vzcreate task.

        A template that is not there is found by the task, as on PVE: its log and exitstatus say
        "unable to create CT <vmid> - volume '<volid>' does not exist".
        """
        vmid = p["vmid"]
        self.check_create(p, user)
        with self.node.locked(vmid):
            if self.node.exists(vmid):
                raise PveError(f"unable to create CT {vmid} - CT {vmid} already exists on node '{self.node.name}'")
            # Reserve the id the way PVE does: a config with 'lock: create' until the task ends.
            pveconf.write(self.node.paths.conf(vmid), pveconf.CtConfig(values={"lock": "create"}))

        def work(task: Task):
            try:
                self.node.create(vmid, p, user, task.log)
            except PveError as exc:
                raise PveError(f"unable to create CT {vmid} - {exc}") from None
            if p.get("start"):
                self.node.start(vmid, task.log)

        def undo():  # a failed create leaves no CT behind (a failed start after it does)
            conf = self.node.paths.conf(vmid)
            if conf.exists() and pveconf.read(conf).values.get("lock") == "create":
                conf.unlink()
                shutil.rmtree(self.node.paths.images(vmid), ignore_errors=True)

        return self.tasks.start("vzcreate", str(vmid), user, work, on_error=undo)

    def check_create(self, p, user: str) -> None:
        """create_vm's checks before the task: a free vmid, no restore, permissions, template, storage, devices."""
        vmid = p["vmid"]
        if self.node.exists(vmid) and not (p.get("restore") and p.get("force")):
            raise PveError(f"CT {vmid} already exists on node '{self.node.name}'")  # check_vmid_unused
        if p.get("restore"):
            raise PveError("the PVE test host does not restore backups (restore=1)")
        unpriv = bool(p.get("unprivileged", 1))
        conf_keys = {k: str(v) for k, v in p.items() if k not in ("node", "vmid", "ostemplate", "password",
                                                                  "ssh-public-keys", "start", "storage", "force",
                                                                  "unprivileged", "ignore-unpack-errors",
                                                                  "bwlimit", "ha-managed", "pool", "unique")}
        self.node.check_modify_perm(user, None, conf_keys, [], unpriv)
        self.node.check_volume_access(p["ostemplate"], user, "vztmpl")
        storage = p.get("storage", "local")
        if "rootfs" not in p and storage != self.node.storage_id:
            raise PveError(f"storage '{storage}' does not exist")
        for k, v in conf_keys.items():
            if re.fullmatch(r"dev\d+", k):
                self.node.check_dev(v)

    def destroy_lxc(self, p, user, **_):
        """pve-container API2/LXC.pm destroy_vm: early checks, then the vzdestroy task."""
        vmid = p["vmid"]
        self.node.check_destroy(vmid, self._need_ct(vmid), bool(p.get("force")))

        def work(task: Task):
            self.node.destroy(vmid, task.log, force=bool(p.get("force")))
            if p.get("purge"):
                task.log(f"purging CT {vmid} from related configurations..")

        return self.tasks.start("vzdestroy", str(vmid), user, work)

    def get_config(self, p, **_):
        """pve-container API2/LXC/Config.pm vm_config (AbstractConfig.pm load_current_config)."""
        if p.get("snapshot") and p.get("current"):
            msg = "cannot use 'snapshot' parameter with 'current'"
            raise param_error({"snapshot": msg, "current": msg})
        conf = self._need_ct(p["vmid"])
        if p.get("snapshot"):
            raise PveError(f"snapshot '{p['snapshot']}' does not exist")  # the test host keeps no snapshots
        values = dict(conf.values)
        if not p.get("current"):
            values.update(conf.pending)
            for k in conf.pending_delete:
                values.pop(k, None)
        out = self.typed_config(values)
        if conf.description:
            out["description"] = conf.description
        if conf.lxc:
            out["lxc"] = [[k, v] for k, v in conf.lxc]
        out["digest"] = conf.digest
        return out

    def put_config(self, p, user, **_):
        """pve-container API2/LXC/Config.pm update_vm (synchronous; null on success)."""
        vmid = p["vmid"]
        new = {k: str(v) for k, v in p.items() if k not in ("node", "vmid", "delete", "digest", "revert")}
        if not {k for k in p if k not in ("node", "vmid", "digest")}:
            raise PveError("no options specified")
        delete = schema.split_list(str(p.get("delete", "")))
        revert = schema.split_list(str(p.get("revert", "")))
        conf = self._need_ct(vmid)
        if conf.values.get("lock"):
            raise PveError(f"CT is locked ({conf.values['lock']})")
        for key in revert:
            if config_option(key) is None:
                raise param_error({"revert": f"unknown option '{key}'"})
            if key in new:
                raise param_error({"revert": f"you can't use '-{key}' and '-revert {key}' at the same time"})
        for key in delete:
            if config_option(key) is None:
                raise param_error({"delete": f"unknown option '{key}'"})
            if key in new:  # sic: PVE's message misses a quote
                raise param_error({"delete": f"you can't use '-{key}' and -delete {key}' at the same time"})
            if key in revert:
                raise param_error({"delete": f"you can't use '-delete {key}' and '-revert {key}' at the same time"})
        self.node.update_config(vmid, new, delete, user, p.get("digest"), revert)

    def get_pending(self, p, **_):
        """pve-container API2/LXC.pm vm_pending (GuestHelpers.pm config_with_pending_array): every
        key of the config (digest and description too, raw lxc.* lines not) with its pending value."""
        conf = self._need_ct(p["vmid"])
        current = self.typed_config(conf.values)
        if conf.description:
            current["description"] = conf.description
        current["digest"] = conf.digest
        pending = self.typed_config(conf.pending)
        out = []
        for k in sorted(current):
            item = {"key": k, "value": current[k]}
            if k in pending:
                item["pending"] = pending[k]
            if k in conf.pending_delete:
                item["delete"] = 1
            out.append(item)
        out += [{"key": k, "pending": v} for k, v in sorted(pending.items()) if k not in current]
        out += [{"key": k, "delete": 1} for k in conf.pending_delete if k not in current]
        return out

    def status_current(self, p, **_):
        """pve-container API2/LXC/Status.pm vm_status: vmstatus plus the HA state."""
        self._need_ct(p["vmid"])
        return {**self.node.status_current(p["vmid"]), "ha": {"managed": 0}}

    def _running(self, vmid: int) -> bool:
        return self.node.exists(vmid) and self.node.status(vmid) == "running"

    def status_start(self, p, user, **_):
        """vm_start: refused at once when running; a CT that does not exist or is locked fails the task."""
        vmid = p["vmid"]
        if p.get("skiplock") and user != "root@pam":
            raise param_error({"skiplock": "Only root may use this option."})
        if self._running(vmid):
            raise PveError(f"CT {vmid} already running")
        return self.tasks.start("vzstart", str(vmid), user, lambda t: self.node.start(vmid, t.log))

    def status_stop(self, p, user, **_):
        vmid = p["vmid"]
        if p.get("skiplock") and user != "root@pam":
            raise param_error({"skiplock": "Only root may use this option."})
        if not self._running(vmid):
            raise PveError(f"CT {vmid} not running")
        return self.tasks.start("vzstop", str(vmid), user, lambda t: self.node.stop(
            vmid, t.log, check_lock=not p.get("skiplock")))

    def status_shutdown(self, p, user, **_):
        vmid = p["vmid"]
        if not self._running(vmid):
            raise PveError(f"CT {vmid} not running")
        timeout = p.get("timeout", 60)
        return self.tasks.start("vzshutdown", str(vmid), user, lambda t: self.node.stop(
            vmid, t.log, timeout=timeout, force=bool(p.get("forceStop")), check_lock=True))

    def status_reboot(self, p, user, **_):
        vmid = p["vmid"]
        if not self._running(vmid):
            raise PveError(f"VM {vmid} not running")  # sic: Status.pm vm_reboot says VM

        def work(task: Task):  # LXC.pm vm_reboot: shut down (killed after the timeout), start
            if self.node.status(vmid) != "running":
                return
            self.node.stop(vmid, task.log, timeout=p.get("timeout", 60), force=True)
            self.node.start(vmid, task.log)

        return self.tasks.start("vzreboot", str(vmid), user, work)

    # --- tasks (pve-manager PVE/API2/Tasks.pm) ------------------------------------------------------
    def _task(self, p) -> Task:
        try:
            parse_upid(p["upid"])
        except ValueError:
            raise param_error({"upid": "unable to parse worker upid"}) from None
        task = self.tasks.get(p["upid"])
        if task is None:
            raise param_error({"upid": "no such task"})
        return task

    def list_tasks(self, p, **_):
        """node_tasks: by default (source=archive) the finished tasks, newest first; 'active' the
        running ones (status RUNNING), 'all' both. total is the number of matches."""
        types = wanted_status_types(p)
        entries = ((t, t.list_entry()) for t in self.task_candidates(p.get("source", "archive")))
        matches = [entry for t, entry in entries if task_matches(p, t, entry, types)]
        start, limit = p.get("start", 0), p.get("limit", 50)
        return WithTotal(matches[start:start + limit], len(matches))

    def task_candidates(self, source: str) -> list[Task]:
        """The running tasks for source 'active', the finished ones newest first for 'archive', 'all' both."""
        tasks = self.tasks.list()
        candidates = []
        if source in ("active", "all"):
            candidates += [t for t in tasks if t.status == "running"]
        if source != "active":
            candidates += sorted((t for t in tasks if t.status == "stopped"), key=lambda t: t.endtime or 0,
                                 reverse=True)
        return candidates

    def get_cluster_tasks(self, p, **_):
        """pve-manager API2/Cluster.pm tasks: the recent tasks, a token's user split as in node_tasks."""
        return [{k: v for k, v in t.list_entry().items() if not (k == "status" and v == "RUNNING")}
                for t in self.tasks.list()]

    def task_status(self, p, **_):
        return self._task(p).status_dict()

    def task_log(self, p, **_):
        """read_task_log (Tools.pm dump_logfile): lines from start, limit of them (0: all), total."""
        task = self._task(p)
        if p.get("download"):
            if "start" in p or "limit" in p:
                raise PveError("'download' cannot be used together with 'start' or 'limit' parameters")
            raise PveError("the PVE test host does not offer task log downloads")
        start, limit = p.get("start", 0), p.get("limit", 50)
        lines = [{"n": i + 1, "t": t} for i, t in enumerate(task.lines)] or [{"n": 1, "t": "no content"}]
        return WithTotal(lines[start:start + limit] if limit else lines[start:], len(lines))

    def task_stop(self, p, **_):
        """stop_task: PVE kills the worker; the test host's tasks are threads and run to their end."""
        self._task(p)


def config_option(key: str) -> dict | None:
    """LXC/Config.pm option_exists: a CT config key (net0, dev3 ...) the schema knows."""
    props = schema.method_schema("/nodes/{node}/lxc/{vmid}/config", "PUT")["parameters"]["properties"]
    return schema.property_schema(props, key)


def real_volume_id(storage: str | None, volume: str) -> tuple[str, str]:
    """pve-storage Content.pm real_volume_id: (volume id, storage) of a volume given with or without its storage."""
    if ":" in volume:
        m = re.fullmatch(r"([a-z][a-z0-9\-_.]*[a-z0-9]):(.+)", volume, re.IGNORECASE)
        if not m:
            raise param_error({"volume": f"unable to parse volume ID '{volume}'\n"})
        if storage and m[1] != storage:
            raise param_error({"volume": f"storage ID mismatch ({m[1]} != {storage})\n"})
        return volume, m[1]
    if not storage:
        raise param_error({"volume": "no storage specified - incomplete volume ID"})
    return f"{storage}:{volume}", storage


def wanted_status_types(p: dict) -> set[str]:
    """node_tasks: the status types statusfilter asks for; errors=1 overrides it with all but 'ok'."""
    if p.get("statusfilter") and not p.get("errors"):
        return {t.lower() for t in schema.split_list(p["statusfilter"])}
    types = {"ok", "warning", "error", "unknown"}
    if p.get("errors"):
        types.discard("ok")
    return types


def task_matches(p: dict, task: Task, entry: dict, types: set[str]) -> bool:
    """Whether a task passes node_tasks' filters (user, type, vmid, since, until, status type)."""
    if p.get("userfilter") and p["userfilter"].lower() not in entry["user"].lower():
        return False
    if p.get("typefilter") and task.type != p["typefilter"]:
        return False
    if p.get("vmid") and task.id != str(p["vmid"]):
        return False
    if "since" in p and task.starttime < p["since"]:
        return False
    if "until" in p and task.starttime > p["until"]:
        return False
    return status_type(task.exitstatus if task.status == "stopped" else None) in types


def status_type(exitstatus: str | None) -> str:
    """pve-common UPID.pm normalize_status_type."""
    if not exitstatus:
        return "unknown"
    if exitstatus == "OK":
        return "ok"
    if re.fullmatch(r"WARNINGS: \d+", exitstatus):
        return "warning"
    return "unknown" if exitstatus == "unexpected status" else "error"
