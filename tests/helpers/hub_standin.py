"""A local stand-in for the Hugging Face hub: the few HTTP endpoints huggingface_hub's snapshot_download and
upload_folder call, serving model repositories held in memory. Tests point HF_ENDPOINT (and, in-process,
huggingface_hub.constants) at it; nothing reaches the network."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class StandinHub:
    """repos: repo id -> {path in the repo: bytes}. requests: (method, path) of each request, in order."""

    def __init__(self):
        self.repos: dict[str, dict[str, bytes]] = {}
        self.requests: list[tuple[str, str]] = []
        self.refuse_writes = False  # answer uploads 403, as the hub answers a token without write access
        self.server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add_dir(self, repo_id: str, directory: Path) -> None:
        self.repos[repo_id] = {p.relative_to(directory).as_posix(): p.read_bytes()
                               for p in sorted(Path(directory).rglob("*")) if p.is_file()}

    def commit(self, repo_id: str) -> str:
        files = self.repos[repo_id]
        return hashlib.sha1(json.dumps({k: git_blob_id(v) for k, v in sorted(files.items())}).encode()).hexdigest()

    def start(self) -> StandinHub:
        hub = self

        class Handler(_Handler):
            standin = hub

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+|[^/]+)/(?P<what>revision|tree|preupload|commit)/(?P<rev>[^/?]+)"
                  r"(?P<rest>/.*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+|[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")


class _Handler(BaseHTTPRequestHandler):
    standin: StandinHub

    def log_message(self, *args) -> None:  # quiet: the test reads `requests`
        pass

    def _json(self, value, status: int = 200, headers: dict | None = None) -> None:
        body = json.dumps(value).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, val in (headers or {}).items():
            self.send_header(key, val)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _not_found(self, repo: str) -> None:
        self._json({"error": f"Repository Not Found for url: {repo}"}, 404,
                   {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"})

    def _route(self):
        path = unquote(urlparse(self.path).path)
        self.standin.requests.append((self.command, path))
        return path, _API.match(path), _RESOLVE.match(path)

    def do_GET(self) -> None:
        path, api, resolve = self._route()
        if api and api["repo"] not in self.standin.repos:
            return self._not_found(api["repo"])
        if api and api["what"] == "revision":
            repo = api["repo"]
            return self._json({"id": repo, "modelId": repo, "sha": self.standin.commit(repo), "private": False,
                               "siblings": [{"rfilename": f} for f in self.standin.repos[repo]]})
        if api and api["what"] == "tree":
            files = self.standin.repos[api["repo"]]
            return self._json([{"type": "file", "path": f, "size": len(data), "oid": git_blob_id(data)}
                               for f, data in files.items()])
        if resolve:
            return self._file(resolve)
        return self._json({"error": f"not served by the stand-in: {path}"}, 404)

    def do_HEAD(self) -> None:
        _, _, resolve = self._route()
        if resolve:
            return self._file(resolve)
        return self._json({}, 404)

    def _file(self, match) -> None:
        files = self.standin.repos.get(match["repo"])
        if files is None:
            return self._not_found(match["repo"])
        if match["file"] not in files:
            return self._json({"error": "Entry not found"}, 404, {"X-Error-Code": "EntryNotFound"})
        data = files[match["file"]]
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{git_blob_id(data)}"')
        self.send_header("X-Repo-Commit", self.standin.commit(match["repo"]))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def do_POST(self) -> None:
        path, api, _ = self._route()
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.standin.refuse_writes and path != "/api/validate-yaml":
            return self._json({"error": "You don't have the rights to create a model under this namespace"}, 403,
                              {"X-Error-Message": "forbidden"})
        if path == "/api/validate-yaml":  # a README.md's metadata: the stand-in finds nothing wrong
            return self._json({"warnings": [], "errors": []})
        if path == "/api/repos/create":
            repo = json.loads(body)
            repo_id = f"{repo['organization']}/{repo['name']}" if repo.get("organization") else repo["name"]
            self.standin.repos.setdefault(repo_id, {})
            return self._json({"url": f"{self.standin.url}/{repo_id}", "name": repo_id})
        if api and api["repo"] not in self.standin.repos:
            return self._not_found(api["repo"])
        if api and api["what"] == "preupload":  # every file goes inline in the commit (no LFS)
            files = json.loads(body)["files"]
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in files]})
        if api and api["what"] == "commit":
            return self._commit(api["repo"], body)
        return self._json({"error": f"not served by the stand-in: {path}"}, 404)

    def _commit(self, repo: str, body: bytes) -> None:
        """An NDJSON commit: a header line, then one line per file with its content in base64."""
        files = self.standin.repos[repo]
        for line in body.decode().splitlines():
            entry = json.loads(line)
            if entry.get("key") == "file":
                value = entry["value"]
                files[value["path"]] = base64.b64decode(value["content"])
            elif entry.get("key") == "deletedFile":
                files.pop(entry["value"]["path"], None)
        commit = self.standin.commit(repo)
        return self._json({"commitUrl": f"{self.standin.url}/{repo}/commit/{commit}", "commitOid": commit,
                           "commitMessage": "", "pullRequestUrl": None})


@contextmanager
def hub_standin(monkeypatch, cache: Path):
    """A started stand-in hub, this process's huggingface_hub pointed at it (its constants are read once, at
    import) and at an empty cache; HF_ENDPOINT and HF_HUB_CACHE set for any child process."""
    from dflash_trainer.infra import hub as infra_hub
    from huggingface_hub import constants

    standin = StandinHub().start()
    monkeypatch.setenv("HF_ENDPOINT", standin.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", standin.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", standin.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    infra_hub.reachable.cache_clear()
    try:
        yield standin
    finally:
        standin.stop()
        infra_hub.reachable.cache_clear()


__all__ = ["StandinHub", "git_blob_id", "hub_standin"]
