"""The window's own small JSON files next to the database (`drafts.json`, `window.json`):
written by the window alone, and never a reason not to start. A file that cannot be read
is an empty one; a write that fails is let go (the state stays in memory)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path


def read_object(path: Path) -> dict:
    """The JSON object in `path`; {} when it is missing, damaged or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def write_atomically(path: Path, data: dict) -> None:
    """`path` holds `data` as ASCII JSON (any str goes, a lone surrogate from a paste
    too), or what it held before: a crash mid-write leaves the previous file, never
    half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(data), encoding="ascii")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
