"""A stand-in for the Hugging Face hub on loopback: the two routes a download uses.

GET /api/models/{repo}[/revision/{rev}]   the repository's file list (JSON)
GET /{repo}/resolve/{rev}/{file}          a file's bytes, optionally slowed down
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, Path], seconds_per_block: float = 0.0) -> None:
        self.repos = repos
        self.seconds_per_block = seconds_per_block
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.requests.append(self.path)
                path = self.path.split("?", 1)[0]
                if path.startswith("/api/models/"):
                    hub.listing(self, path[len("/api/models/") :].split("/revision/")[0])
                elif "/resolve/" in path:
                    repo, rest = path[1:].split("/resolve/", 1)
                    hub.file(self, repo, rest.split("/", 1)[1])
                else:
                    self.send_error(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def listing(self, handler: BaseHTTPRequestHandler, repo: str) -> None:
        folder = self.repos.get(repo)
        if folder is None:
            handler.send_response(404)
            handler.send_header("X-Error-Code", "RepoNotFound")
            handler.send_header("Content-Type", "application/json")
            handler.end_headers()
            handler.wfile.write(b'{"error": "Repository not found"}')
            return
        siblings = [
            {"rfilename": f.name, "size": f.stat().st_size}
            for f in sorted(folder.iterdir())
            if f.is_file()
        ]
        body = json.dumps({"id": repo, "modelId": repo, "sha": SHA, "siblings": siblings})
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        handler.wfile.write(body.encode())

    def file(self, handler: BaseHTTPRequestHandler, repo: str, name: str) -> None:
        path = self.repos.get(repo, Path("/nonexistent")) / name
        if not path.is_file():
            handler.send_error(404)
            return
        data = path.read_bytes()
        handler.send_response(200)
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        for start in range(0, len(data), 1 << 16):
            if self.seconds_per_block:
                time.sleep(self.seconds_per_block)
            try:
                handler.wfile.write(data[start : start + (1 << 16)])
            except (BrokenPipeError, ConnectionResetError):
                return
