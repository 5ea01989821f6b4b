"""A stand-in Hugging Face Hub on 127.0.0.1, for the real ``huggingface_hub`` to download from
(``HF_ENDPOINT`` pointing at it): the revision, tree and resolve endpoints ``snapshot_download``
calls, with the hub's answers for a missing repository or revision and a gated repository.
huggingface_hub has no public API that fills its cache without downloading, so the tests let it
download from here, then load offline. It serves only what it was given, counts the requests
per file, and stops with the ``with`` block."""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class StandInHub:
    """``repos``: repo id -> {file path: bytes}; ``gated``: repo ids that answer 403 as a gated
    repository does to a client without a token; ``broken``: files ("repo/path") whose next N
    downloads stop halfway, the connection closed."""

    def __init__(self, repos: dict[str, dict[str, bytes]], gated=(), broken=()):
        self.repos, self.gated = repos, set(gated)
        self.broken = dict(broken)  # "repo/path" -> GETs that drop the connection halfway
        self.downloads: dict[str, int] = {}  # "repo/path" -> GETs of the file
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> StandInHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ----- answers ------------------------------------------------------------------------

    def _answer(self, req: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(req.path).path)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo, kind, revision = "/".join(parts[2:4]), parts[4], parts[5]
            if self._refused(req, repo, revision):
                return
            if kind == "revision":
                files = sorted(self.repos[repo])
                info = {
                    "id": repo,
                    "modelId": repo,
                    "sha": COMMIT,
                    "private": False,
                    "gated": False,
                    "siblings": [{"rfilename": f} for f in files],
                }
                return self._json(req, info, body)
            if kind == "tree":
                return self._json(
                    req, [self._entry(p, d) for p, d in self.repos[repo].items()], body
                )
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, revision, file = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
            if self._refused(req, repo, revision):
                return
            data = self.repos[repo].get(file)
            if data is None:
                return self._error(req, 404, "EntryNotFound", f"{file} not found")
            return self._file(req, repo, file, data, body)
        self._error(req, 404, None, f"no such endpoint {path}")

    def _refused(self, req, repo: str, revision: str) -> bool:
        if repo in self.gated:
            self._error(req, 403, "GatedRepo", f"Access to model {repo} is restricted.")
            return True
        if repo not in self.repos:
            self._error(req, 404, "RepoNotFound", "Repository not found")
            return True
        if revision not in ("main", COMMIT):
            self._error(req, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return True
        return False

    @staticmethod
    def _entry(path: str, data: bytes) -> dict:
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's blob id
        return {"type": "file", "oid": blob, "size": len(data), "path": path}

    def _file(self, req, repo: str, file: str, data: bytes, body: bool) -> None:
        start = 0
        ranged = req.headers.get("Range", "")
        if body and ranged.startswith("bytes="):
            start = int(ranged[6:].split("-")[0] or 0)
        req.send_response(206 if start else 200)
        req.send_header("X-Repo-Commit", COMMIT)
        req.send_header("ETag", f'"{self._entry(file, data)["oid"]}"')
        req.send_header("Content-Length", str(len(data) - start))
        req.send_header("Content-Type", "application/octet-stream")
        req.end_headers()
        if body:
            key = f"{repo}/{file}"
            self.downloads[key] = self.downloads.get(key, 0) + 1
            if self.broken.get(key, 0) > 0:
                self.broken[key] -= 1
                req.wfile.write(data[start : start + (len(data) - start) // 2])
                req.wfile.flush()
                req.close_connection = True
                req.connection.shutdown(socket.SHUT_RDWR)
                return
            req.wfile.write(data[start:])

    @staticmethod
    def _json(req, value, body: bool) -> None:
        data = json.dumps(value).encode()
        req.send_response(200)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if body:
            req.wfile.write(data)

    @staticmethod
    def _error(req, status: int, code: str | None, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        req.send_response(status)
        if code:
            req.send_header("X-Error-Code", code)
            req.send_header("X-Error-Message", message)
        req.send_header("Content-Type", "application/json")
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        if req.command != "HEAD":
            req.wfile.write(data)


def folder_files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` by its relative path: a repository's contents."""
    from pathlib import Path

    root = Path(folder)
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}
