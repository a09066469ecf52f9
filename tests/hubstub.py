"""A Hugging Face Hub stand-in on loopback: the routes `huggingface_hub` calls to resolve a
revision, list a repo and fetch its files (ranges included), served from local directories.

Reached through HF_ENDPOINT, so the real download path runs: resolve, list, HEAD, GET, the
cache layout, resume. It records every request, can refuse repos as gated, and can cut one
file's first transfer after some bytes, as a dropped connection does.
"""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


def commit_of(repo: str) -> str:
    return hashlib.sha1(repo.encode()).hexdigest()


class HubStub:
    def __init__(self, repos: dict[str, Path], gated: tuple[str, ...] = ()):
        self.repos, self.gated = repos, set(gated)
        self.requests: list[tuple[str, str, str]] = []     # (method, path, Range header)
        self.cut_after: dict[str, int] = {}                 # file name -> bytes, once
        self._lock = threading.Lock()

    def __enter__(self) -> "HubStub":
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self) -> list[str]:
        """The file paths fetched with GET (not HEAD) so far."""
        return [p for m, p, _ in self.requests if m == "GET" and "/resolve/" in p]

    def files(self, repo: str) -> list[Path]:
        root = self.repos[repo]
        return sorted(f for f in root.rglob("*") if f.is_file())

    def _handler(self):
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _fail(self, status: int, code: str) -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                self.send_header("Content-Type", "application/json")
                data = json.dumps({"error": code}).encode()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command == "GET":
                    self.wfile.write(data)

            def _json(self, obj) -> None:
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self, body: bool) -> None:
                path = unquote(urlparse(self.path).path)
                with stub._lock:
                    stub.requests.append((self.command, path, self.headers.get("Range", "")))
                parts = path.strip("/").split("/")
                api = parts[:2] == ["api", "models"]
                repo = "/".join(parts[2:4] if api else parts[0:2])
                if repo not in stub.repos:
                    return self._fail(404, "RepoNotFound")
                if repo in stub.gated:
                    return self._fail(403, "GatedRepo")
                rest = parts[4:] if api else parts[2:]
                if len(rest) < 2 or rest[1] not in ("main", commit_of(repo)):
                    return self._fail(404, "RevisionNotFound")
                root = stub.repos[repo]
                if api and rest[0] == "revision":
                    return self._json({"id": repo, "sha": commit_of(repo), "siblings": [
                        {"rfilename": str(f.relative_to(root))} for f in stub.files(repo)]})
                if api and rest[0] == "tree":
                    return self._json([self._entry(f, root) for f in stub.files(repo)])
                if not api and rest[0] == "resolve":
                    return self._file(repo, root / "/".join(rest[2:]), body)
                return self._fail(404, "EntryNotFound")

            def _entry(self, f: Path, root: Path) -> dict:
                data = f.read_bytes()
                entry = {"type": "file", "path": str(f.relative_to(root)), "size": len(data),
                         "oid": hashlib.sha1(data).hexdigest()}
                if f.suffix == ".safetensors":
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                    "pointerSize": 134}
                return entry

            def _file(self, repo: str, file: Path, body: bool) -> None:
                if not file.is_file():
                    return self._fail(404, "EntryNotFound")
                data = file.read_bytes()
                start = 0
                asked = self.headers.get("Range", "")
                if asked.startswith("bytes="):
                    start = int(asked[len("bytes="):].split("-")[0])
                self.send_response(206 if start else 200)
                self.send_header("X-Repo-Commit", commit_of(repo))
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("Content-Length", str(len(data) - start))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if not body:
                    return
                with stub._lock:
                    cut = stub.cut_after.pop(file.name, None)
                if cut is not None:
                    self.wfile.write(data[start:start + cut])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self.wfile.write(data[start:])

        return Handler
