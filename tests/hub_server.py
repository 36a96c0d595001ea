"""A stand-in for the Hugging Face hub on loopback: the two routes a download uses.

GET /api/models/{repo}[/revision/{rev}]   the repository's file list (JSON)
GET /{repo}/resolve/{rev}/{file}          a file's bytes, optionally slowed down

and the ways a hostile or failing hub serves a file (`Misbehaviour`): more bytes than it
listed, no size listed, a line that stalls or closes mid-file, a listed file it lacks.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SHA = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Misbehaviour:
    """What the hub does wrong with one file (by name); all off by default."""

    extra: int = 0  # bytes sent beyond the file (and beyond its listed size)
    unlisted: bool = False  # the listing gives no size
    stall_after: int | None = None  # bytes sent, then nothing until the hub closes
    close_after: int | None = None  # bytes sent, then the connection closes
    missing: bool = False  # listed, but a 404 when asked for
    listed: object = ...  # the size the listing gives (...: the file's own)
    redirect_to: str | None = None  # another hub's endpoint, where the file is sent on to
    redirect_body: int = 0  # bytes the redirect's own answer carries
    no_length: bool = False  # no Content-Length: the body ends when the line closes
    linger_s: float = 0.0  # after the last byte, the wait before the line closes


@dataclass
class Sent:
    counts: dict[str, int] = field(default_factory=dict)  # bytes of each file sent


class FakeHub:
    def __init__(
        self,
        repos: dict[str, Path],
        seconds_per_block: float = 0.0,
        misbehaviour: dict[str, Misbehaviour] | None = None,
        host: str = "127.0.0.1",
        sha: object = SHA,
        more_listed: list[dict] | None = None,
    ) -> None:
        """`sha`, `more_listed`: the listing's revision, and entries it adds as they are
        (hostile shapes)."""
        self.repos = repos
        self.seconds_per_block = seconds_per_block
        self.misbehaviour = misbehaviour or {}
        self.sha, self.more_listed = sha, more_listed or []
        self.sent = Sent()
        self.closing = threading.Event()
        self.stalled = threading.Event()  # a file's bytes have stopped (`stall_after`)
        self.requests: list[str] = []
        self.authorizations: list[str | None] = []  # each request's Authorization header
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub.requests.append(self.path)
                hub.authorizations.append(self.headers.get("Authorization"))
                path = self.path.split("?", 1)[0]
                if path.startswith("/api/models/"):
                    hub.listing(self, path[len("/api/models/") :].split("/revision/")[0])
                elif "/resolve/" in path:
                    repo, rest = path[1:].split("/resolve/", 1)
                    hub.file(self, repo, rest.split("/", 1)[1])
                else:
                    self.send_error(404)

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.endpoint = f"http://{host}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.closing.set()
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
            {"rfilename": f.name, "size": self._listed_size(f)}
            for f in sorted(folder.iterdir())
            if f.is_file()
        ]
        siblings += self.more_listed
        body = json.dumps({"id": repo, "modelId": repo, "sha": self.sha, "siblings": siblings})
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.end_headers()
        handler.wfile.write(body.encode())

    def _wrong(self, name: str) -> Misbehaviour:
        return self.misbehaviour.get(name, Misbehaviour())

    def _listed_size(self, path: Path) -> object:
        wrong = self._wrong(path.name)
        if wrong.unlisted:
            return None
        return path.stat().st_size if wrong.listed is ... else wrong.listed

    def file(self, handler: BaseHTTPRequestHandler, repo: str, name: str) -> None:
        path = self.repos.get(repo, Path("/nonexistent")) / name
        wrong = self._wrong(name)
        if not path.is_file() or wrong.missing:
            handler.send_error(404)
            return
        if wrong.redirect_to:
            self.redirect(handler, f"{wrong.redirect_to}{handler.path}", wrong.redirect_body)
            return
        data = path.read_bytes() + bytes(wrong.extra)
        handler.send_response(200)
        if wrong.no_length:
            handler.close_connection = True
        else:
            handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        self.sent.counts[name] = 0
        for start in range(0, len(data), 1 << 16):
            if self.seconds_per_block:
                time.sleep(self.seconds_per_block)
            if wrong.stall_after is not None and start >= wrong.stall_after:
                handler.wfile.flush()
                self.stalled.set()
                self.closing.wait()
                return
            if wrong.close_after is not None and start >= wrong.close_after:
                handler.close_connection = True
                return
            try:
                handler.wfile.write(data[start : start + (1 << 16)])
            except (BrokenPipeError, ConnectionResetError):
                return
            self.sent.counts[name] += len(data[start : start + (1 << 16)])
        if wrong.linger_s:
            handler.wfile.flush()
            time.sleep(wrong.linger_s / 2)  # the bytes sent are read by now
            self.stalled.set()
            time.sleep(wrong.linger_s / 2)

    def redirect(self, handler: BaseHTTPRequestHandler, location: str, body: int) -> None:
        handler.send_response(302)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", str(body))
        handler.end_headers()
        self.sent.counts["redirect"] = 0
        for _ in range(body >> 16):
            try:
                handler.wfile.write(bytes(1 << 16))
            except (BrokenPipeError, ConnectionResetError):
                return
            self.sent.counts["redirect"] += 1 << 16
