"""The SQLite database: opening it, and its schema as append-only migrations.

One `Database` per thread (sqlite-utils ties a connection to the thread that
made it). WAL mode lets the GUI read while the worker writes. A database that
cannot be used (damaged, read-only, locked, on a full disk) is refused with a
message saying what to do, never a traceback.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import sqlite_utils
from sqlite_utils import Migrations

from sessions import paths
from sessions.errors import StorageError, UserError, storage_error, storage_errors

DB_NAME = "reprise.db"
# How long a write waits for another process's write to finish before it says so.
BUSY_TIMEOUT_S = 10.0

migrations = Migrations("reprise")
# The per-chat settings (m004) and their column types; the names are the preferences'.
CHAT_OVERRIDE_COLUMNS = {
    "temperature": float,
    "top_p": float,
    "min_p": float,
    "repetition_penalty": float,
    "max_tokens": int,
    "kv_bits": int,
}


class NewerDatabase(UserError):
    """The database was written by a newer Reprise; we refuse rather than damage it."""


@migrations()
def m001_conversations(db: sqlite_utils.Database) -> None:
    db["conversations"].create(
        {
            "id": int,
            "title": str,
            "model": str,
            "system_prompt": str,
            "settings": str,  # JSON: sampling and KV settings used
            "current_message_id": int,  # the leaf of the branch on screen
            "created": str,
            "updated": str,
        },
        pk="id",
    )
    db["messages"].create(
        {
            "id": int,
            "conversation_id": int,
            "parent_id": int,  # the message this one answers or follows; NULL for the first
            "role": str,
            "content": str,
            # "complete", "streaming", "cancelled", "failed", "interrupted" (the process
            # died while streaming: see sessions.repair)
            "state": str,
            "stats": str,  # JSON TurnStats for assistant messages
            "created": str,
            "updated": str,
        },
        pk="id",
        foreign_keys=[("conversation_id", "conversations", "id")],
    )
    db["messages"].create_index(["conversation_id"])
    db["messages"].enable_fts(["content"], create_triggers=True, tokenize="porter")
    db["settings"].create({"key": str, "value": str}, pk="key")


@migrations()
def m002_cache_index(db: sqlite_utils.Database) -> None:
    db["cache_chunks"].create(
        {
            "key": str,  # hash of (model fingerprint, KV format, token prefix up to token_end)
            "url": str,  # file:// URL inside the cache root
            "model_fingerprint": str,
            "kv_format": str,
            "token_start": int,
            "token_end": int,
            "bytes": int,
            "created": str,
            "last_used": str,
        },
        pk="key",
    )
    db["conversation_caches"].create(
        {
            "conversation_id": int,
            "model_fingerprint": str,
            "kv_format": str,
            "tokens": bytes,  # the exact token ids in the cache, int32 little-endian
            "chunk_tokens": int,  # chunk length used when saving
            "chunk_keys": str,  # JSON list, in token order
            "updated": str,
        },
        pk="conversation_id",
    )
    db["cache_chunks"].create_index(["last_used"])


@migrations()
def m003_measurements(db: sqlite_utils.Database) -> None:
    # Running estimates for the reopen planner: disk read bandwidth, and prefill
    # rate per model and KV format.
    db["measurements"].create({"key": str, "value": float, "updated": str}, pk="key")


@migrations()
def m004_chat_overrides(db: sqlite_utils.Database) -> None:
    # A chat's own sampling and KV preference; NULL: the default from the preferences.
    # (kv_bits 16 is a chat's own "Off": NULL already means "the default".)
    table = db["conversations"]
    for name, kind in CHAT_OVERRIDE_COLUMNS.items():
        table.add_column(name, kind)


@migrations()
def m005_checkpoint_keys(db: sqlite_utils.Database) -> None:
    # A cache that cannot be cut along the token axis keeps its chunkable layers in
    # token chunks (chunk_keys) and the rest in one checkpoint per turn's end
    # (checkpoint_keys, JSON list, oldest first). A whole snapshot saved before
    # (chunk_tokens 0) is a checkpoint that holds every layer.
    db["conversation_caches"].add_column("checkpoint_keys", str)
    db.execute(
        "update conversation_caches set checkpoint_keys = chunk_keys, chunk_keys = '[]' "
        "where chunk_tokens = 0"
    )


@migrations()
def m006_checkpoint_rows(db: sqlite_utils.Database) -> None:
    # A checkpoint that holds only the window rows since the one before it
    # (app/engine/window_rows.py) records where its own rows begin; NULL: its rows are
    # all its own (a chunk, or a checkpoint saved before).
    db["cache_chunks"].add_column("rows_from", int)


@migrations()
def m007_repetition_penalty_default(db: sqlite_utils.Database) -> None:
    # Every save of the preferences wrote each of them, the repetition penalty's old
    # default too (1.0: off); its default is 1.1 now (app/service/preferences.py: the
    # starter model looped with it off). A stored 1.0 is that old default nearly always,
    # so it goes and the new default applies; one who wants it off sets it again.
    if db["settings"].exists():
        db.execute("delete from settings where key = 'repetition_penalty' and value = '1.0'")


def open_db(
    path: Path | None = None,
    busy_timeout_s: float = BUSY_TIMEOUT_S,
    read_only: bool = False,
    handed_over: bool = False,
) -> sqlite_utils.Database:
    """Open (creating or upgrading) the database; refuse one from a newer Reprise, and
    one that cannot be used, with a `UserError` that says what to do.

    `read_only` is the window's connection: once the schema is current, SQLite
    refuses every write on it (`query_only`), so the window can only read.

    `handed_over`: the connection may be used on another thread than this one, one
    thread at a time (the terminal's prefetch runs on a thread the first turn joins)."""
    if path is None:
        with storage_errors():
            path = paths.data_dir() / DB_NAME
    if path.is_dir():
        raise StorageError(f"{path} is a folder where the database should be; move it aside.")
    conn = None
    try:
        conn = sqlite3.connect(str(path), timeout=busy_timeout_s, check_same_thread=not handed_over)
        conn.text_factory = _text
        db = _prepare(sqlite_utils.Database(conn), path)
        if read_only:
            db.execute("PRAGMA query_only=ON")
        return db
    except (sqlite3.Error, OSError) as exc:
        if conn is not None:
            conn.close()
        raise storage_error(exc, path) from exc


def _text(raw: bytes) -> str:
    """A TEXT value as str. Another program can store bytes that are not UTF-8; the
    default factory then fails every query that reads the row (the whole sidebar, for
    one damaged title), so such bytes read as U+FFFD instead."""
    return raw.decode("utf-8", errors="replace")


def _prepare(db: sqlite_utils.Database, path: Path) -> sqlite_utils.Database:
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA foreign_keys=ON")
    known = {m.name for m in migrations._migrations}
    unknown = [m.name for m in migrations.applied(db) if m.name not in known]
    if unknown:
        db.conn.close()
        raise NewerDatabase(
            f"{path} was written by a newer version of Reprise (schema steps "
            f"{', '.join(unknown)}); update Reprise to open it. Nothing was changed."
        )
    migrations.apply(db)
    return db


def is_row_id(number: int) -> bool:
    """Whether `number` can be a row id; past SQLite's 64-bit integers a query would
    overflow (OverflowError) instead of finding nothing."""
    return 1 <= number < 2**63
