"""Errors a user can act on, kept apart from bugs.

A `UserError` carries a message meant for the person using the app (shown as
is in the terminal or a dialog); any other exception is a bug and is reported
with its traceback. It lives in the lowest layer so every layer can raise it.

Storage failures (SQLite and the file system) are the user's to fix too: a
damaged or locked database, a read-only folder, a full disk. `storage_error`
is the one place that turns them into a message saying what happened and what
to do; `storage_errors` applies it to a block of code.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar


class UserError(Exception):
    """Something the user can fix: a bad file, a missing model, a full disk."""


class StorageError(UserError):
    """The database or a data folder cannot be used as it is."""


class DatabaseDamaged(StorageError):
    pass


class DatabaseLocked(StorageError):
    pass


class ReadOnlyStorage(StorageError):
    pass


class DiskFull(StorageError):
    pass


_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
# SQLite's primary result codes (the low byte of an extended code), and the words of
# its messages for Pythons that do not carry the code (3.10).
_SQLITE_CODES = {
    13: "full",
    5: "locked",
    6: "locked",
    11: "damaged",
    26: "damaged",
    8: "read-only",
    14: "read-only",
    23: "read-only",
}
_SQLITE_WORDS = (
    ("disk is full", "full"),
    ("is locked", "locked"),
    ("is busy", "locked"),
    ("not a database", "damaged"),
    ("malformed", "damaged"),
    ("readonly", "read-only"),
    ("unable to open", "read-only"),
)


def _sqlite_kind(exc: sqlite3.Error) -> str | None:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF in _SQLITE_CODES:
        return _SQLITE_CODES[code & 0xFF]
    lowered = str(exc).lower()
    return next((kind for words, kind in _SQLITE_WORDS if words in lowered), None)


def storage_error(exc: BaseException, path: Path | str | None = None) -> UserError:
    """The message for a failed SQLite or file operation on `path` (a database or folder).

    A `UserError` passes through unchanged; anything that is not a storage failure
    comes back as is too (wrapped, so callers can always `raise ... from exc`).
    """
    if isinstance(exc, UserError):
        return exc
    where = f" at {path}" if path else ""
    text = str(exc)
    if isinstance(exc, sqlite3.Error):
        kind = _sqlite_kind(exc)
        if kind == "full":
            return DiskFull(
                f"The disk holding the database{where} is full. Free some space, then try "
                "again; nothing already saved was lost."
            )
        if kind == "locked":
            return DatabaseLocked(
                f"The database{where} is locked: another Reprise (a window or a terminal) is "
                "writing to it. Wait for it to finish or close it, then try again."
            )
        if kind == "damaged":
            return DatabaseDamaged(
                f"The database{where} is damaged ({text}). Move it aside to start fresh; "
                "your cache files are safe."
            )
        if kind == "read-only":
            return ReadOnlyStorage(
                f"The database{where} cannot be written ({text}): its file or folder is "
                "read-only. Make it writable (or point REPRISE_DATA_DIR elsewhere), then try "
                "again."
            )
        return StorageError(f"The database{where} could not be used ({text}).")
    if isinstance(exc, OSError):
        target = exc.filename or path or "a data folder"
        reason = exc.strerror or text
        if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
            return DiskFull(f"The disk holding {target} is full. Free some space, then try again.")
        if exc.errno in _READ_ONLY_ERRNOS:
            return ReadOnlyStorage(
                f"Reprise cannot write to {target} ({reason}). Make it writable, or point "
                "Reprise at another folder (REPRISE_DATA_DIR, REPRISE_CACHE_DIR), then try again."
            )
        return StorageError(f"Reprise could not use {target} ({reason}).")
    return UserError(text)


@contextlib.contextmanager
def storage_errors(path: Path | str | None = None) -> Iterator[None]:
    """Raise a clear `UserError` for any SQLite or OS failure inside the block."""
    try:
        yield
    except (sqlite3.Error, OSError) as exc:
        raise storage_error(exc, path) from exc


def database_path(conn: sqlite3.Connection) -> str | None:
    """The file behind a connection, for messages; None for an in-memory database."""
    try:
        rows = conn.execute("pragma database_list").fetchall()
    except sqlite3.Error:
        return None
    return next((row[2] for row in rows if row[1] == "main" and row[2]), None)


Method = TypeVar("Method", bound=Callable[..., Any])


def guarded(method: Method) -> Method:
    """Decorate a method of an object with a `db` (sqlite-utils) so that storage
    failures inside it become clear messages naming the database file."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (sqlite3.Error, OSError) as exc:
            raise storage_error(exc, database_path(self.db.conn)) from exc

    return call  # type: ignore[return-value]


class CacheRejected(Exception):
    """A cache file or index row cannot be used; `reason` says why in a few words.

    Not a `UserError`: the caller recomputes and notes the reason in the turn's stats.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class CacheUnreadable(CacheRejected):
    """A cache file the system could not read just now (an I/O error, too many open
    files, no permission): refused for this turn, but nothing says the file is damaged,
    so it is kept."""
