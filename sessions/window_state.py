"""Where the window was: its geometry and the sidebar's share, as Qt gives them (base64
text), and the chat it showed (its id), kept across restarts in `window.json` next to
the database. Written by the window
alone when it closes, as drafts are (sessions/drafts.py): the database has one writer,
the worker, stopped by then. A file that cannot be read is no state, never an error: the
window opens at its default size.
"""

from __future__ import annotations

from pathlib import Path

from sessions.jsonfile import read_object, write_atomically

FILE_NAME = "window.json"
# What Qt writes is well under a kilobyte of base64; a longer value is not ours.
_MAX_VALUE = 4096


def load(path: Path) -> dict[str, str]:
    """The state in `path`: text values under their names; anything else is skipped."""
    return {
        name: value
        for name, value in read_object(path).items()
        if isinstance(value, str) and value.isascii() and len(value) <= _MAX_VALUE
    }


def save(path: Path, state: dict[str, str]) -> None:
    """Atomically; a write that fails (a full disk, a read-only folder) is let go."""
    write_atomically(path, state)
