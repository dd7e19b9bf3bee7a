"""A stand-in for the Hugging Face Hub, in the test process: the two routes a pull uses, answered the way the
Hub answers them, for repositories held in memory.

* ``GET /api/models/{repo}[/revision/{rev}]?blobs=true``: the repository's info, its files with ``size``,
  ``blobId`` (git blob sha1) and, for large files, ``lfs.sha256``;
* ``GET /{repo}/resolve/{rev}/{path}``: the file, with ``Range`` honoured (206).

Faults a test sets: ``cut_after[path] = N`` ends the next transfers of ``path`` after N bytes (its
count says how many), ``corrupt[path]`` serves other bytes than the listed hash. ``requests``
records each file request's path and ``Range`` header.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

#: files at least this large are LFS files on the Hub (the real threshold is 10 MB; small here)
LFS_THRESHOLD = 1024
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    license: str = "apache-2.0"
    sha: str = COMMIT


@dataclass
class Hub:
    repos: dict[str, Repo] = field(default_factory=dict)
    #: path → (bytes to send before cutting, how many more transfers to cut)
    cut_after: dict[str, tuple[int, int]] = field(default_factory=dict)
    corrupt: set[str] = field(default_factory=set)
    requests: list[tuple[str, str]] = field(default_factory=list)
    #: the Authorization header of every request ("" when none)
    auth: list[str] = field(default_factory=list)
    url: str = ""

    def info(self, repo_id: str) -> dict:
        repo = self.repos[repo_id]
        siblings = []
        for path, data in sorted(repo.files.items()):
            s: dict = {"rfilename": path, "size": len(data),
                       "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
            if len(data) >= LFS_THRESHOLD:
                s["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
            siblings.append(s)
        return {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False, "siblings": siblings,
                "cardData": {"license": repo.license}, "tags": ["gguf"]}


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

        def _send(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802
            hub.auth.append(self.headers.get("Authorization", ""))
            path = unquote(urlparse(self.path).path)
            if path.startswith("/api/models/"):
                rest = path[len("/api/models/"):]
                repo_id = "/".join(rest.split("/")[:2])
                if repo_id not in hub.repos:
                    self._send(404, json.dumps({"error": "Repository not found"}).encode(),
                               {"X-Error-Code": "RepoNotFound", "Content-Type": "application/json"})
                    return
                self._send(200, json.dumps(hub.info(repo_id)).encode(), {"Content-Type": "application/json"})
                return
            parts = path.strip("/").split("/")
            if len(parts) < 5 or parts[2] != "resolve":
                self._send(404, b"{}")
                return
            repo_id, file_path = "/".join(parts[:2]), "/".join(parts[4:])
            repo = hub.repos.get(repo_id)
            if repo is None or file_path not in repo.files:
                self._send(404, b"{}", {"X-Error-Code": "EntryNotFound"})
                return
            data = repo.files[file_path]
            if file_path in hub.corrupt:
                data = bytes(b ^ 0xFF for b in data[:16]) + data[16:]
            rng = self.headers.get("Range", "")
            hub.requests.append((file_path, rng))
            start = int(rng.split("=")[1].split("-")[0]) if rng.startswith("bytes=") else 0
            if start >= len(data) and data:
                self._send(416, b"")
                return
            body = data[start:]
            code = 206 if rng else 200
            headers = {"ETag": f'"{hashlib.sha256(repo.files[file_path]).hexdigest()}"', "X-Repo-Commit": repo.sha,
                       "Accept-Ranges": "bytes"}
            if rng:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            cut = hub.cut_after.get(file_path)
            if cut is not None and cut[1] > 0 and self.command == "GET":
                hub.cut_after[file_path] = (cut[0], cut[1] - 1)
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[: cut[0]])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # the peer sees the transfer end short
                return
            self._send(code, body, headers)

    return Handler


class HubServer:
    """``Hub`` served on a loopback port, on a thread, for a ``with`` block."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
        self._server.daemon_threads = True
        hub.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Hub:
        self._thread.start()
        return self.hub

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
