"""The index of KV-cache chunk files in SQLite (docs/architecture.md §5).

The files themselves (contained URLs, atomic writes, checked reads) are
`sessions.chunkio`; their rows are checked in `sessions.cacherows`. This module
keeps which chunks exist and which conversation uses which, and never lets a
damaged row or file escape as an exception: each becomes a `CacheRejected`
(the caller recomputes) or is skipped and collected.

- Atomic: the index row is written after the file exists; a chunk is deleted
  row first, then file, so a crash leaves an orphan file, never a row
  pointing at nothing.
- Bounded: `evict_to_budget` drops least-recently-used chunks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import sqlite_utils

from sessions.cacherows import (
    ConversationCache,
    chunk_entry,
    conversation_entry,
    is_key,
    listed_keys,
)
from sessions.chunkio import (
    FORMAT_VERSION,
    STALE_TEMP_SECONDS,
    TMP_PREFIX,
    Loader,
    is_stale_temp,
    kv_root,
    load_numpy,
    now,
    path_from_url,
    paths_from_urls,
    read_ahead,
    read_file,
    tensor_names,
    write_file,
)
from sessions.db import is_row_id
from sessions.errors import CacheRejected, CacheUnreadable, DiskFull

__all__ = [
    "FORMAT_VERSION",
    "CacheIndex",
    "CacheRejected",
    "CacheUnreadable",
    "ConversationCache",
    "DiskFull",
    "kv_root",
    "load_numpy",
    "now",
    "path_from_url",
    "paths_from_urls",
    "read_ahead",
    "read_file",
    "tensor_names",
    "write_file",
]

SUFFIX = ".safetensors"


# SQLite's default limit on a statement's variables is 999 (older builds); stay below.
_KEYS_PER_QUERY = 500


class CacheIndex:
    """The SQLite side: which chunks exist, which conversation uses which."""

    def __init__(self, db: sqlite_utils.Database, root: Path | None = None) -> None:
        self.db = db
        self.root = root or kv_root()

    def chunk_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    # -- chunks ------------------------------------------------------------------

    def chunk(self, key: str) -> dict | None:
        """The chunk's row, checked; None if there is none or it is damaged."""
        try:
            return self._chunk_row(key)
        except CacheRejected:
            return None

    def _chunk_row(self, key: str) -> dict | None:
        try:
            rows = list(self.db["cache_chunks"].rows_where("key = ?", [key]))
        except sqlite3.DatabaseError as exc:
            raise CacheRejected(f"the cache index cannot be read ({exc})") from exc
        return chunk_entry(rows[0]) if rows else None

    def chunks(self, keys: list[str]) -> dict[str, dict]:
        """`chunk` for many keys in one query: the checked row of each that has one
        (a restore reads tens of rows, and a query each cost a millisecond)."""
        found: dict[str, dict] = {}
        for i in range(0, len(keys), _KEYS_PER_QUERY):
            part = list(keys[i : i + _KEYS_PER_QUERY])
            where = f"key in ({', '.join('?' * len(part))})"
            try:
                rows = list(self.db["cache_chunks"].rows_where(where, part))
            except sqlite3.DatabaseError as exc:
                raise CacheRejected(f"the cache index cannot be read ({exc})") from exc
            for row in rows:
                try:
                    found[row["key"]] = chunk_entry(row)
                except CacheRejected:
                    continue  # damaged: as if it had no row, as `chunk` has it
        return found

    def chunk_rows(self) -> Iterator[tuple[object, dict | None]]:
        """(key as stored, checked row or None where it is damaged) for every chunk."""
        for row in list(self.db["cache_chunks"].rows):
            try:
                yield row.get("key"), chunk_entry(row)
            except CacheRejected:
                yield row.get("key"), None

    def add_chunk(
        self,
        key: str,
        path: Path,
        size: int,
        fingerprint: str,
        kv_format: str,
        start: int,
        end: int,
        rows_from: int | None = None,
    ) -> None:
        """`rows_from`: where a checkpoint's own window rows begin, when it leaves those
        before to the checkpoint before it (app/engine/window_rows.py)."""
        stamp = now()
        self.db["cache_chunks"].upsert(
            {
                "key": key,
                "url": path.as_uri(),
                "model_fingerprint": fingerprint,
                "kv_format": kv_format,
                "token_start": start,
                "token_end": end,
                "rows_from": rows_from,
                "bytes": size,
                "created": stamp,
                "last_used": stamp,
            },
            pk="key",
        )

    def read_chunk(
        self,
        key: str,
        expect: Mapping[str, str],
        load: Loader = load_numpy,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> tuple[dict, dict[str, str], dict]:
        """(tensors, metadata, row) of chunk `key`, checked against its row (the file
        must be the one this index names for the key, of the size it wrote) and
        `expect`/`shapes` (see `read_file`). A rejected chunk is deleted, so the next
        save writes it afresh rather than reusing a file that can never be read."""
        row = None
        try:
            row = self._chunk_row(key)
            if row is None:
                raise CacheRejected("cache files were evicted")
            path = path_from_url(row["url"], self.root)
            if path != self.chunk_path(key).resolve():
                raise CacheRejected("the index names another file for this chunk")
            tensors, metadata = read_file(path, expect, load, shapes=shapes, size=row["bytes"])
        except CacheRejected:
            if row is not None or self._has_row(key):
                self.delete_chunk(key)
            raise
        return tensors, metadata, row

    def _has_row(self, key: object) -> bool:
        return (
            self.db.execute("select 1 from cache_chunks where key = ?", [key]).fetchone()
            is not None
        )

    def touch(self, keys: list[str]) -> None:
        # One transaction: `db.execute` would commit (and sync) each row on its own.
        stamp = now()
        with self.db.conn:
            self.db.conn.executemany(
                "update cache_chunks set last_used = ? where key = ?", [(stamp, k) for k in keys]
            )

    def delete_chunk(self, key: object) -> None:
        """Row first, then file: a crash in between leaves an orphan file for gc,
        never a row pointing at nothing. The file deleted is the key's own, never
        what a (possibly damaged) URL names."""
        with self.db.conn:
            self.db.execute("delete from cache_chunks where key = ?", [key])
        if is_key(key):
            with contextlib.suppress(OSError):  # a folder planted there stays
                self.chunk_path(key).unlink(missing_ok=True)

    # -- conversations -------------------------------------------------------------

    def set_conversation(self, entry: ConversationCache) -> None:
        self.db["conversation_caches"].upsert(
            {
                "conversation_id": entry.conversation_id,
                "model_fingerprint": entry.model_fingerprint,
                "kv_format": entry.kv_format,
                "tokens": np.asarray(entry.tokens, dtype="<i4").tobytes(),
                "chunk_tokens": entry.chunk_tokens,
                "chunk_keys": json.dumps(entry.chunk_keys),
                "checkpoint_keys": json.dumps(entry.checkpoint_keys),
                "updated": now(),
            },
            pk="conversation_id",
        )

    def conversation(self, conversation_id: int) -> ConversationCache | None:
        """The conversation's saved cache; None if there is none or its row is damaged
        (`checked_conversation` says why)."""
        try:
            return self.checked_conversation(conversation_id)
        except CacheRejected:
            return None

    def checked_conversation(self, conversation_id: int) -> ConversationCache | None:
        """The conversation's saved cache, None if there is none, or `CacheRejected`."""
        if not is_row_id(conversation_id):
            return None
        try:
            rows = list(
                self.db["conversation_caches"].rows_where("conversation_id = ?", [conversation_id])
            )
        except sqlite3.DatabaseError as exc:
            raise CacheRejected(f"the cache index cannot be read ({exc})") from exc
        return conversation_entry(rows[0]) if rows else None

    def _conversation_entries(self) -> Iterator[ConversationCache]:
        for row in list(self.db["conversation_caches"].rows):
            with contextlib.suppress(CacheRejected):
                yield conversation_entry(row)

    def forget_conversation(self, conversation_id: int) -> None:
        self.db["conversation_caches"].delete_where("conversation_id = ?", [conversation_id])

    def other_caches(self, conversation_id: int) -> list[tuple[frozenset[str] | None, int]]:
        """Every other conversation's cache as (its chunk keys, its token count); None for
        keys that cannot be read (the cautious answer: it may hold any chunk). Only the
        key lists and the token lists' sizes are read (a save asks it, and the token
        lists grow with every chat)."""
        rows = self.db.execute(
            "select chunk_keys, length(tokens) / 4 from conversation_caches"
            " where conversation_id is not ?",
            [conversation_id],
        )
        caches: list[tuple[frozenset[str] | None, int]] = []
        for listed, length in rows:
            try:
                keys = json.loads(listed)
            except (TypeError, ValueError, RecursionError):  # nested past the parser's depth
                keys = None
            readable = isinstance(keys, list) and isinstance(length, int)
            caches.append((frozenset(map(str, keys)) if readable else None, length))
        return caches

    def _listed(self, column: str, other_than: int | None = None) -> set[str]:
        """The keys conversations list in `column` ("chunk_keys" or "checkpoint_keys"),
        but `other_than`'s: only that column is read, and a list that cannot be read
        adds none."""
        assert column in ("chunk_keys", "checkpoint_keys")
        rows = self.db.execute(
            f"select {column} from conversation_caches where conversation_id is not ?",
            [other_than],
        )
        return {key for (raw,) in rows for key in listed_keys(raw) or ()}

    def drop_unshared(self, conversation_id: int, keys: set[str]) -> None:
        """Delete those of `keys` (files a restore of the conversation found unusable)
        that no other conversation lists: what one chat cannot use may serve another
        (files are shared by prefix). Best effort: a database that cannot be written
        now (locked, read-only) leaves them, and the restore is refused all the same."""
        try:
            others = self._listed("chunk_keys", conversation_id)
            for key in keys - others - self._listed("checkpoint_keys", conversation_id):
                self.delete_chunk(key)
        except (sqlite3.Error, OSError):
            pass

    def referenced_keys(self) -> set[str]:
        keys: set[str] = set()
        for entry in self._conversation_entries():
            keys.update(entry.all_keys)
        return keys

    # -- the whole cache -------------------------------------------------------------

    def usage(self) -> tuple[int, int]:
        """(chunk count, bytes) of the whole cache."""
        row = self.db.execute(
            "select count(*), coalesce(sum(case when typeof(bytes) = 'integer' and bytes > 0 "
            "then bytes else 0 end), 0) from cache_chunks"
        ).fetchone()
        return row[0], row[1]

    def conversations_summary(self) -> list[dict]:
        """Per conversation: tokens, bytes on disk, KV format, last used."""
        # One read of the chunk table, not a query per chunk: the sidebar asks after every turn.
        chunks = {row["key"]: row for _, row in self.chunk_rows() if row}
        summary = []
        for entry in self._conversation_entries():
            present = [chunks[k] for k in entry.all_keys if k in chunks]
            summary.append(
                {
                    "conversation_id": entry.conversation_id,
                    "tokens": len(entry.tokens),
                    "bytes": sum(c["bytes"] for c in present),
                    "chunks": len(entry.all_keys),
                    "chunks_on_disk": len(present),
                    "kv_format": entry.kv_format,
                    "last_used": max((c["last_used"] for c in present), default=entry.updated),
                }
            )
        return summary

    def evict_to_budget(self, budget_bytes: int, keep: set[str] = frozenset()) -> int:
        """Delete least-recently-used chunks until the cache fits; return bytes freed.

        Files used together (a restore's, a save's) share one stamp; of those the ones
        that end later go first. A conversation's chunks and checkpoints need the ones
        before them, never the ones after: taken from the end, what stays still
        restores the conversation's start, where one taken from the middle would
        leave every file after it unusable."""
        _, used = self.usage()
        freed = 0
        if used <= budget_bytes:
            return 0
        checkpoints = self._listed("checkpoint_keys")

        def needed_after(row: dict) -> tuple[int, int]:
            """Where the files after it begin to need it: a chunk, its first token (a
            checkpoint ending later needs it); a checkpoint, its end. At one position the
            chunk goes first: the checkpoint there needs only the chunks before."""
            if row["key"] in checkpoints:
                return row["token_end"], 0
            return row["token_start"], 1

        rows = sorted(
            (row for _, row in self.chunk_rows() if row),
            key=lambda row: (row["last_used"], *(-n for n in needed_after(row)), row["key"]),
        )
        for row in rows:
            if used - freed <= budget_bytes:
                break
            if row["key"] in keep:
                continue
            self.delete_chunk(row["key"])
            freed += row["bytes"]
        return freed

    def clear(self) -> None:
        """Forget every conversation's cache and delete every chunk file."""
        with self.db.conn:
            self.db["conversation_caches"].delete_where()
        for key, _row in list(self.chunk_rows()):
            self.delete_chunk(key)  # row, then file: never a row without its file
        self.collect_garbage()  # files without rows, once old enough to be nobody's save

    def release(self, keys: set[str]) -> None:
        """Delete those of `keys` that no conversation uses any more."""
        for key in keys - self.referenced_keys():
            self.delete_chunk(key)

    def drop_missing(self) -> dict[str, int]:
        """Drop damaged chunk rows and rows whose file is gone (safe while another
        process saves: a row is only ever written after its file)."""
        dropped = {"damaged_rows": 0, "missing_rows": 0}
        for key, row in self.chunk_rows():
            if row is None:
                self.delete_chunk(key)
                dropped["damaged_rows"] += 1
                continue
            try:
                exists = path_from_url(row["url"], self.root).is_file()
            except (CacheRejected, OSError):
                exists = False
            if not exists:
                with self.db.conn:
                    self.db.execute("delete from cache_chunks where key = ?", [key])
                dropped["missing_rows"] += 1
        return dropped

    def remove_stale_temp_files(self) -> int:
        """Temp files whose writer is gone (a kill during a save); a live writer's stay."""
        removed = 0
        for path in self._files():
            if path.name.startswith(TMP_PREFIX) and is_stale_temp(path):
                with contextlib.suppress(OSError):
                    path.unlink()
                    removed += 1
        return removed

    def collect_garbage(self, orphan_age: float = STALE_TEMP_SECONDS) -> dict[str, int]:
        """Remove stale temp files, files without rows (older than `orphan_age`: a
        file another process just wrote gets its row a moment later), damaged rows,
        rows without files, unreferenced chunks."""
        removed = {"temp_files": self.remove_stale_temp_files(), "orphan_files": 0}
        known = {key for key, _ in self.chunk_rows()}
        for path in self._files():
            if path.suffix == SUFFIX and path.stem not in known:
                with contextlib.suppress(OSError):
                    if time.time() - path.stat().st_mtime > orphan_age:
                        path.unlink()
                        removed["orphan_files"] += 1
        removed |= self.drop_missing()
        with self.db.conn:  # entries nothing can use: their chunks are collected below
            damaged = [
                row["conversation_id"]
                for row in self.db["conversation_caches"].rows
                if not _valid_entry(row)
            ]
            for conversation_id in damaged:
                self.db.execute(
                    "delete from conversation_caches where conversation_id is ?", [conversation_id]
                )
        removed["damaged_entries"] = len(damaged)
        referenced = self.referenced_keys()
        removed["unreferenced"] = 0
        for key, row in list(self.chunk_rows()):
            # A chunk a save just added is referenced once the save ends: give it time.
            if row and key not in referenced and _age_s(row["created"]) > orphan_age:
                self.delete_chunk(key)
                removed["unreferenced"] += 1
        return removed

    def _files(self) -> Iterator[Path]:
        """Regular files under the root (symlinks are not followed)."""
        for folder, _, names in os.walk(self.root, followlinks=False):
            for name in names:
                path = Path(folder, name)
                with contextlib.suppress(OSError):
                    if path.is_file() and not path.is_symlink():
                        yield path

    def verify(self) -> list[dict]:
        """Check every indexed file; return the bad ones with their reasons."""
        bad = []
        for key, row in self.chunk_rows():
            if row is None:
                bad.append({"key": str(key), "url": "", "reason": "damaged index row"})
                continue
            expect = {
                "model": row["model_fingerprint"],
                "kv_format": row["kv_format"],
                "key": row["key"],
                "token_start": str(row["token_start"]),
                "token_end": str(row["token_end"]),
            }
            try:
                path = path_from_url(row["url"], self.root)
                read_file(path, expect, size=row["bytes"])
            except CacheRejected as exc:
                bad.append({"key": row["key"], "url": row["url"], "reason": exc.reason})
        return bad


def _age_s(stamp: str) -> float:
    """Seconds since `stamp` (as `now()` writes it); a damaged one counts as old."""
    try:
        then = datetime.fromisoformat(stamp)
    except (TypeError, ValueError):
        return math.inf
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - then).total_seconds()


def _valid_entry(row: dict) -> bool:
    try:
        conversation_entry(row)
    except CacheRejected:
        return False
    return True
