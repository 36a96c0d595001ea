"""KV-cache chunk files on disk and their index in SQLite (DESIGN.md §4).

This module knows files, bytes and rows, not models: tensors arrive and leave
as numpy arrays with string metadata; the engine decides what they mean.

- Contained: a stored `file://` URL is only opened if it resolves inside the
  cache root.
- Checked: every file carries a format version, the caller's expectations
  (model fingerprint, KV format, token range, ...) and a CRC-32 of its
  tensors; any mismatch raises `CacheRejected` with a reason.
- Atomic: written to a temporary file in the same folder, fsynced, renamed;
  the index row is written after the file exists.
- Bounded: `evict_to_budget` drops least-recently-used chunks.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np
import sqlite_utils
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from sessions import paths
from sessions.errors import UserError

FORMAT_VERSION = "1"
_TMP_PREFIX = ".tmp-"


class CacheRejected(Exception):
    """A cache file cannot be used; `reason` says why in a few words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DiskFull(UserError):
    pass


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def kv_root() -> Path:
    root = paths.cache_dir() / "kv"
    root.mkdir(parents=True, exist_ok=True)
    return root


def checksum(tensors: dict[str, np.ndarray]) -> str:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(tensors[name]).view(np.uint8).data, crc)
    return f"{crc:08x}"


def path_from_url(url: str, root: Path | None = None) -> Path:
    """The file a stored URL names, refused unless it is a file:// URL inside the cache root."""
    root = (root or kv_root()).resolve()
    parsed = urlparse(url)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise CacheRejected(f"not a local file URL: {url}")
    path = Path(unquote(parsed.path)).resolve()
    if not path.is_relative_to(root):
        raise CacheRejected(f"outside the cache folder: {url}")
    return path


def write_file(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> int:
    """Write a safetensors file atomically; return its size."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # safetensors writes an array's underlying buffer: a strided view must be compacted first.
    tensors = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    metadata = {**metadata, "reprise.format": FORMAT_VERSION, "checksum": checksum(tensors)}
    tmp = path.with_name(f"{_TMP_PREFIX}{os.getpid()}-{path.name}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, SafetensorError) as exc:
        tmp.unlink(missing_ok=True)
        # safetensors reports I/O failures as its own error, with the OS error in the text.
        if getattr(exc, "errno", None) == errno.ENOSPC or "os error 28" in str(exc):
            raise DiskFull(
                f"The disk is full; the conversation's cache was not saved ({path.parent})"
            ) from exc
        raise OSError(f"The cache file {path.name} could not be written: {exc}") from exc
    _fsync_dir(path.parent)
    return path.stat().st_size


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


Loader = Callable[[Path], tuple[dict, dict[str, str]]]


def load_numpy(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    with safe_open(str(path), framework="np") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)
        return tensors, f.metadata() or {}


def read_file(path: Path, expect: dict[str, str], load: Loader = load_numpy) -> tuple[dict, dict]:
    """Read and check a chunk file against `expect` (metadata that must match exactly).

    `load` reads the tensors; the engine passes one that reads straight into its own
    arrays. Any array type that numpy can view (the buffer protocol) works.
    """
    if not path.is_file():
        raise CacheRejected("file missing")
    try:
        tensors, metadata = load(path)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CacheRejected(f"unreadable file ({exc})") from exc
    if metadata.get("reprise.format") != FORMAT_VERSION:
        raise CacheRejected("not a Reprise cache file of this version")
    for key, value in expect.items():
        if metadata.get(key) != value:
            raise CacheRejected(f"{key} does not match")
    if checksum(tensors) != metadata.get("checksum"):
        raise CacheRejected("checksum mismatch (damaged file)")
    return tensors, metadata


@dataclass
class ConversationCache:
    conversation_id: int
    model_fingerprint: str
    kv_format: str
    tokens: list[int]
    chunk_tokens: int
    chunk_keys: list[str]
    updated: str = ""


class CacheIndex:
    """The SQLite side: which chunks exist, which conversation uses which."""

    def __init__(self, db: sqlite_utils.Database, root: Path | None = None) -> None:
        self.db = db
        self.root = root or kv_root()

    def chunk_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def chunk(self, key: str) -> dict | None:
        rows = list(self.db["cache_chunks"].rows_where("key = ?", [key]))
        return rows[0] if rows else None

    def add_chunk(
        self,
        key: str,
        path: Path,
        size: int,
        fingerprint: str,
        kv_format: str,
        start: int,
        end: int,
    ) -> None:
        stamp = now()
        self.db["cache_chunks"].upsert(
            {
                "key": key,
                "url": path.as_uri(),
                "model_fingerprint": fingerprint,
                "kv_format": kv_format,
                "token_start": start,
                "token_end": end,
                "bytes": size,
                "created": stamp,
                "last_used": stamp,
            },
            pk="key",
        )

    def touch(self, keys: list[str]) -> None:
        stamp = now()
        with self.db.conn:
            for key in keys:
                self.db.execute("update cache_chunks set last_used = ? where key = ?", [stamp, key])

    def set_conversation(self, entry: ConversationCache) -> None:
        self.db["conversation_caches"].upsert(
            {
                "conversation_id": entry.conversation_id,
                "model_fingerprint": entry.model_fingerprint,
                "kv_format": entry.kv_format,
                "tokens": np.asarray(entry.tokens, dtype="<i4").tobytes(),
                "chunk_tokens": entry.chunk_tokens,
                "chunk_keys": json.dumps(entry.chunk_keys),
                "updated": now(),
            },
            pk="conversation_id",
        )

    def conversation(self, conversation_id: int) -> ConversationCache | None:
        rows = list(
            self.db["conversation_caches"].rows_where("conversation_id = ?", [conversation_id])
        )
        if not rows:
            return None
        row = rows[0]
        return ConversationCache(
            conversation_id=row["conversation_id"],
            model_fingerprint=row["model_fingerprint"],
            kv_format=row["kv_format"],
            tokens=np.frombuffer(row["tokens"], dtype="<i4").tolist(),
            chunk_tokens=row["chunk_tokens"],
            chunk_keys=json.loads(row["chunk_keys"]),
            updated=row["updated"],
        )

    def forget_conversation(self, conversation_id: int) -> None:
        self.db["conversation_caches"].delete_where("conversation_id = ?", [conversation_id])

    def usage(self) -> tuple[int, int]:
        """(chunk count, bytes) of the whole cache."""
        row = next(
            self.db.query("select count(*) as n, coalesce(sum(bytes), 0) as b from cache_chunks")
        )
        return row["n"], row["b"]

    def conversations_summary(self) -> list[dict]:
        """Per conversation: tokens, bytes on disk, KV format, last used."""
        # One read of the chunk table, not a query per chunk: the sidebar asks after every turn.
        chunks = {c["key"]: c for c in self.db["cache_chunks"].rows}
        summary = []
        for row in self.db["conversation_caches"].rows:
            keys = json.loads(row["chunk_keys"])
            present = [chunks[k] for k in keys if k in chunks]
            summary.append(
                {
                    "conversation_id": row["conversation_id"],
                    "tokens": len(row["tokens"]) // 4,
                    "bytes": sum(c["bytes"] for c in present),
                    "chunks": len(keys),
                    "chunks_on_disk": len(present),
                    "kv_format": row["kv_format"],
                    "last_used": max((c["last_used"] for c in present), default=row["updated"]),
                }
            )
        return summary

    def delete_chunk(self, key: str) -> None:
        """Row first, then file: a crash in between leaves an orphan file for gc,
        never a row pointing at nothing."""
        row = self.chunk(key)
        with self.db.conn:
            self.db["cache_chunks"].delete_where("key = ?", [key])
        if row:
            with contextlib.suppress(CacheRejected):  # never delete outside the cache root
                path_from_url(row["url"], self.root).unlink(missing_ok=True)

    def evict_to_budget(self, budget_bytes: int, keep: set[str] = frozenset()) -> int:
        """Delete least-recently-used chunks until the cache fits; return bytes freed."""
        _, used = self.usage()
        freed = 0
        if used <= budget_bytes:
            return 0
        for row in self.db["cache_chunks"].rows_where(order_by="last_used, key"):
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
        self.collect_garbage()

    def release(self, keys: set[str]) -> None:
        """Delete those of `keys` that no conversation uses any more."""
        for key in keys - self.referenced_keys():
            self.delete_chunk(key)

    def referenced_keys(self) -> set[str]:
        keys: set[str] = set()
        for row in self.db["conversation_caches"].rows:
            keys.update(json.loads(row["chunk_keys"]))
        return keys

    def collect_garbage(self) -> dict[str, int]:
        """Remove temp files, files without rows, rows without files, unreferenced chunks."""
        removed = {"temp_files": 0, "orphan_files": 0, "missing_rows": 0, "unreferenced": 0}
        known = {row["key"] for row in self.db["cache_chunks"].rows}
        for path in self.root.rglob("*"):
            if not path.is_file():
                continue
            if path.name.startswith(_TMP_PREFIX):
                path.unlink(missing_ok=True)
                removed["temp_files"] += 1
            elif path.suffix == ".safetensors" and path.stem not in known:
                path.unlink(missing_ok=True)
                removed["orphan_files"] += 1
        for row in list(self.db["cache_chunks"].rows):
            try:
                exists = path_from_url(row["url"], self.root).is_file()
            except CacheRejected:
                exists = False
            if not exists:
                self.db["cache_chunks"].delete_where("key = ?", [row["key"]])
                removed["missing_rows"] += 1
        referenced = self.referenced_keys()
        for key in known - referenced:
            if self.chunk(key):
                self.delete_chunk(key)
                removed["unreferenced"] += 1
        return removed

    def verify(self) -> list[dict]:
        """Check every indexed file; return the bad ones with their reasons."""
        bad = []
        for row in self.db["cache_chunks"].rows:
            expect = {
                "model": row["model_fingerprint"],
                "kv_format": row["kv_format"],
                "key": row["key"],
                "token_start": str(row["token_start"]),
                "token_end": str(row["token_end"]),
            }
            try:
                read_file(path_from_url(row["url"], self.root), expect)
            except CacheRejected as exc:
                bad.append({"key": row["key"], "url": row["url"], "reason": exc.reason})
        return bad
