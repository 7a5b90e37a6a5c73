"""A local server speaking the Hugging Face Hub's file API (the part huggingface_hub's
snapshot_download, hf_hub_download and model_info use), so hf:// sources are exercised over
real HTTP with no hub reachable: point HF_ENDPOINT at it.

    GET  /api/models/{repo}/revision/{rev}     repo info: sha (the commit) and siblings
    GET  /api/models/{repo}/tree/{rev}          the files (recursive), as newer clients list
    HEAD /{repo}/resolve/{rev}/{path}           X-Repo-Commit, ETag, Content-Length
    GET  /{repo}/resolve/{rev}/{path}           the file

Repositories are local folders, published per (repo, revision); a commit id is derived from the
folder's files, so new contents under a branch are a new commit, and a commit id works as a
revision wherever one does. With `token` set, every call
needs `Authorization: Bearer <token>` (401 otherwise), as a private repository does.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/revision/(?P<rev>[^/]+)$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)/tree/(?P<rev>[^/]+)(?:/.*)?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


@dataclass
class HubServer:
    endpoint: str = ""
    token: str | None = None
    repos: dict[tuple[str, str], Path] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path) served

    def publish(self, repo: str, folder: Path, revision: str = "main") -> str:
        """Serve `folder` as `repo` at `revision`; returns its commit id."""
        self.repos[(repo, revision)] = Path(folder)
        return self.commit(repo, revision)

    def find(self, repo: str, revision: str) -> str | None:
        """The published revision `revision` names (itself, or the one whose commit it is)."""
        if (repo, revision) in self.repos:
            return revision
        return next(
            (r for (name, r) in self.repos if name == repo and self.commit(name, r) == revision),
            None,
        )

    def commit(self, repo: str, revision: str) -> str:
        folder = self.repos[(repo, revision)]
        digest = hashlib.sha1(repo.encode())
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                digest.update(str(path.relative_to(folder)).encode() + path.read_bytes())
        return digest.hexdigest()

    def files(self, repo: str, revision: str) -> dict[str, Path]:
        folder = self.repos[(repo, revision)]
        return {str(p.relative_to(folder)): p for p in sorted(folder.rglob("*")) if p.is_file()}


def _handler(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _fail(self, status: int, code: str, message: str) -> None:
            body = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, value: object) -> None:
            body = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _authorized(self) -> bool:
            if hub.token is None:
                return True
            return self.headers.get("Authorization") == f"Bearer {hub.token}"

        def _serve(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path))
            if not self._authorized():
                return self._fail(401, "RepoNotFound", "Invalid credentials in Authorization")
            info, tree, resolve = _INFO.match(path), _TREE.match(path), _RESOLVE.match(path)
            match = info or tree or resolve
            if match is None:
                return self._fail(404, "EntryNotFound", f"no route {path}")
            repo, asked = match["repo"], match["rev"]
            if not any(r == repo for r, _ in hub.repos):
                return self._fail(404, "RepoNotFound", f"Repository {repo} not found")
            rev = hub.find(repo, asked)
            if rev is None:
                return self._fail(404, "RevisionNotFound", f"Invalid rev id: {asked}")
            commit, files = hub.commit(repo, rev), hub.files(repo, rev)
            if tree is not None:
                entries = [
                    {"type": "file", "path": name, "size": p.stat().st_size, "oid": _sha1(p)}
                    for name, p in files.items()
                ]
                return self._json(entries)
            if info is not None:
                siblings = [
                    {"rfilename": name, "size": p.stat().st_size, "blobId": _sha1(p)}
                    for name, p in files.items()
                ]
                body = {
                    "_id": commit[:24],
                    "id": repo,
                    "modelId": repo,
                    "sha": commit,
                    "private": hub.token is not None,
                    "gated": False,
                    "disabled": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                    "lastModified": "2026-01-01T00:00:00.000Z",
                    "createdAt": "2026-01-01T00:00:00.000Z",
                    "siblings": siblings,
                }
                return self._json(body)
            file = files.get(resolve["path"])  # type: ignore[index]
            if file is None:
                return self._fail(404, "EntryNotFound", f"{resolve['path']} not found")  # type: ignore[index]
            data = file.read_bytes()
            self.send_response(200)
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Content-Type", "application/octet-stream")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)
            return None

        do_GET = _serve
        do_HEAD = _serve

    return Handler


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@contextmanager
def running_hub(token: str | None = None) -> Iterator[HubServer]:
    hub = HubServer(token=token)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
