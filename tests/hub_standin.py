"""A loopback stand-in for the Hub's upload API, enough for huggingface_hub's create_repo,
create_branch, upload_folder and create_commit (HTTP uploads, no Xet/LFS), for model and dataset repositories.

Every request is recorded (method, path, headers, body); each repository keeps the files its
commits wrote, decoded, per revision, so a test can assert exactly what a push left there.
Anything it does not serve answers 404 and stays in ``requests`` for the test to see.

    with HubStandIn() as hub:
        HfApi(endpoint=hub.url).upload_folder(...)
        hub.files("org/name")  # {path: bytes}
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import yaml

USER = "standin-user"  # the namespace of a repository created without one


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Commit:
    repo_id: str
    revision: str
    summary: str
    oid: str
    files: dict[str, bytes]


@dataclass
class Repo:
    private: bool | None
    kind: str = "model"  # create_repo's type: model or dataset
    revisions: dict[str, dict[str, bytes]] = field(default_factory=lambda: {"main": {}})


_REPO = r"(?P<repo_id>[^/]+/[^/]+)"
_ROUTES = [
    ("GET", re.compile(r"^/api/agent-harnesses$"), "agent_harnesses"),
    ("POST", re.compile(r"^/api/repos/create$"), "create_repo"),
    ("POST", re.compile(r"^/api/validate-yaml$"), "validate_yaml"),
    ("POST", re.compile(rf"^/api/(?:models|datasets)/{_REPO}/preupload/(?P<revision>.+)$"), "preupload"),
    ("POST", re.compile(rf"^/api/(?:models|datasets)/{_REPO}/commit/(?P<revision>.+)$"), "commit"),
    ("POST", re.compile(rf"^/api/(?:models|datasets)/{_REPO}/branch/(?P<branch>.+)$"), "create_branch"),
]


class HubStandIn:
    def __init__(self):
        self.requests: list[Request] = []
        self.repos: dict[str, Repo] = {}
        self.commits: list[Commit] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> HubStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    # --- what tests read --------------------------------------------------------------------------

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return dict(self.repos[repo_id].revisions[revision])

    def unserved(self) -> list[str]:
        """Requests the stand-in answered 404 (endpoints it does not know)."""
        return [f"{r.method} {r.path}" for r in self.requests if not _route(r.method, urlsplit(r.path).path)[0]]

    # --- endpoints ----------------------------------------------------------------------------------

    def agent_harnesses(self, body: dict) -> tuple[int, dict]:
        """huggingface_hub's user-agent detection reads this registry once per process."""
        return 200, {"standardEnvVars": [], "harnesses": {}}

    def create_repo(self, body: dict) -> tuple[int, dict]:
        repo_id = f"{body.get('organization') or USER}/{body['name']}"
        url = f"{self.url}/{repo_id}"
        if repo_id in self.repos:
            return 409, {"error": "You already created this model repo", "url": url}
        self.repos[repo_id] = Repo(private=body.get("visibility") == "private" if "visibility" in body else body.get("private"),
                                   kind=body.get("type") or "model")
        return 200, {"url": url, "name": repo_id}

    def validate_yaml(self, body: dict) -> tuple[int, dict]:
        """The Hub checks a README's front matter; here: it must be a YAML mapping."""
        text = body.get("content", "")
        errors = []
        if text.startswith("---\n"):
            try:
                metadata = yaml.safe_load(text[4 : text.index("\n---", 4)])
                if not isinstance(metadata, dict):
                    errors.append({"message": "front matter is not a mapping"})
            except (ValueError, yaml.YAMLError) as err:
                errors.append({"message": f"invalid YAML front matter: {err}"})
        return 200, {"errors": errors, "warnings": []}

    def create_branch(self, repo_id: str, branch: str, body: dict) -> tuple[int, dict]:
        repo = self.repos.get(repo_id)
        if repo is None:
            return 404, {"error": f"Repository {repo_id} not found"}
        if branch in repo.revisions:
            return 409, {"error": f"Reference {branch} already exists"}
        repo.revisions[branch] = dict(repo.revisions["main"])
        return 200, {}

    def preupload(self, repo_id: str, revision: str, body: dict) -> tuple[int, dict]:
        if repo_id not in self.repos or revision not in self.repos[repo_id].revisions:
            return 404, {"error": f"Repository {repo_id}@{revision} not found"}
        files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]
        return 200, {"files": files}

    def commit(self, repo_id: str, revision: str, body: list[dict]) -> tuple[int, dict]:
        """body: the ndjson lines, a header then one line per file (base64) or deletion."""
        lines = body
        repo = self.repos.get(repo_id)
        if repo is None or revision not in repo.revisions:
            return 404, {"error": f"Repository {repo_id}@{revision} not found"}
        header = next(line["value"] for line in lines if line["key"] == "header")
        written = {}
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                if value.get("encoding") != "base64":
                    return 400, {"error": f"unexpected file encoding {value.get('encoding')!r}"}
                written[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] in ("deletedFile", "deletedFolder"):
                prefix = value["path"].rstrip("/")
                for path in [p for p in repo.revisions[revision] if p == prefix or p.startswith(prefix + "/")]:
                    del repo.revisions[revision][path]
            elif line["key"] != "header":
                return 400, {"error": f"stand-in does not handle commit lines of kind {line['key']!r}"}
        repo.revisions[revision].update(written)
        oid = hashlib.sha1(json.dumps([repo_id, len(self.commits), sorted(written)]).encode()).hexdigest()
        self.commits.append(Commit(repo_id, revision, header.get("summary", ""), oid, written))
        return 200, {"commitUrl": f"{self.url}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}


def _route(method: str, path: str):
    for route_method, pattern, name in _ROUTES:
        match = pattern.match(path)
        if method == route_method and match:
            return name, {k: unquote(v) for k, v in match.groupdict().items()}
    return None, {}


def _handler_for(hub: HubStandIn):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # keep test output clean
            pass

        def _serve(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            with hub._lock:
                hub.requests.append(Request(self.command, self.path, dict(self.headers), body))
                name, params = _route(self.command, urlsplit(self.path).path)
                if name is None:
                    status, answer = 404, {"error": f"stand-in: {self.command} {self.path} is not served"}
                else:
                    if name == "commit":
                        payload = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    else:
                        payload = json.loads(body or b"{}")
                    status, answer = getattr(hub, name)(body=payload, **params)
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status >= 400:
                self.send_header("X-Error-Message", answer.get("error", ""))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _serve

    return Handler
