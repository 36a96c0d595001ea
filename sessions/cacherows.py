"""The cache index's rows, checked: the database is untrusted bytes too.

A row may have been damaged by a crash, a disk, another program or a person
with a SQLite shell: NULLs, text where a number belongs, a BLOB of the wrong
length, JSON that is not JSON. Every such row becomes a `CacheRejected` with a
reason (the caller recomputes), never an exception from deep inside a turn.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field

import numpy as np

from sessions.errors import CacheRejected

# Chunk keys are hex digests (kvstore.chunk_keys); a key is also a file name.
KEY_PATTERN = re.compile(r"[0-9a-f]{8,128}")
MAX_TEXT = 4096


@dataclass
class ConversationCache:
    conversation_id: int
    model_fingerprint: str
    kv_format: str
    tokens: list[int]
    chunk_tokens: int
    chunk_keys: list[str]  # token chunks, in token order
    updated: str = ""
    # Checkpoints at turns' ends, oldest first: the layers chunks cannot hold
    # (sliding windows, recurrent state), for caches that have such layers.
    checkpoint_keys: list[str] = field(default_factory=list)

    @property
    def all_keys(self) -> list[str]:
        """Every file the entry uses: its chunks and its checkpoints."""
        return [*self.chunk_keys, *self.checkpoint_keys]


def is_key(value: object) -> bool:
    return isinstance(value, str) and KEY_PATTERN.fullmatch(value) is not None


def _int(row: dict, column: str, low: int = 0) -> int:
    value = row.get(column)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise CacheRejected(f"damaged index row ({column} is {_shown(value)})")
    return value


def _text(row: dict, column: str, optional: bool = False) -> str:
    value = row.get(column)
    if optional and value is None:
        return ""
    if not isinstance(value, str) or (not optional and not value) or len(value) > MAX_TEXT:
        raise CacheRejected(f"damaged index row ({column} is {_shown(value)})")
    return value


def _shown(value: object) -> str:
    if value is None:
        return "NULL"
    return f"a {type(value).__name__}" if not isinstance(value, str) else "bad text"


def conversation_entry(row: dict) -> ConversationCache:
    """A `conversation_caches` row as an entry, or `CacheRejected` saying what is wrong."""
    conversation_id = _int(row, "conversation_id")
    blob = row.get("tokens")
    if not isinstance(blob, bytes) or not blob or len(blob) % 4:
        raise CacheRejected(f"damaged index row (tokens is {_shown(blob)})")
    tokens = np.frombuffer(blob, dtype="<i4")
    if int(tokens.min()) < 0:
        raise CacheRejected("damaged index row (a negative token id)")
    chunk_tokens = _int(row, "chunk_tokens")
    keys = listed_keys(row.get("chunk_keys"))
    checkpoints = [] if row.get("checkpoint_keys") is None else listed_keys(row["checkpoint_keys"])
    if checkpoints is None:
        raise CacheRejected("damaged index row (checkpoint_keys is not a list of keys)")
    if keys is None or not (keys or checkpoints):
        raise CacheRejected("damaged index row (chunk_keys is not a list of keys)")
    # Chunks of at most chunk_tokens cover the tokens in order (their spans are in
    # their own rows); a cache of checkpoints alone has no chunk length (0).
    if bool(keys) != bool(chunk_tokens) or (
        keys and not math.ceil(len(tokens) / chunk_tokens) <= len(keys) <= len(tokens)
    ):
        raise CacheRejected("damaged index row (chunk_keys do not match the tokens)")
    return ConversationCache(
        conversation_id=conversation_id,
        model_fingerprint=_text(row, "model_fingerprint"),
        kv_format=_text(row, "kv_format"),
        tokens=tokens.tolist(),
        chunk_tokens=chunk_tokens,
        chunk_keys=keys,
        updated=_text(row, "updated", optional=True),
        checkpoint_keys=checkpoints,
    )


def listed_keys(raw: object) -> list[str] | None:
    """A JSON list of chunk keys (maybe empty), as an index row stores one; None when it
    is anything else."""
    try:
        keys = json.loads(raw) if isinstance(raw, str | bytes) else None
    except (ValueError, RecursionError):
        return None
    if not isinstance(keys, list) or not all(is_key(k) for k in keys):
        return None
    return keys


def chunk_entry(row: dict) -> dict:
    """A `cache_chunks` row with every column checked, or `CacheRejected`."""
    if not is_key(row.get("key")):
        raise CacheRejected("damaged index row (not a chunk key)")
    start = _int(row, "token_start")
    end = _int(row, "token_end", low=start)
    rows_from = None if row.get("rows_from") is None else _int(row, "rows_from", low=start)
    if rows_from is not None and rows_from > end:
        raise CacheRejected(f"damaged index row (rows_from is {rows_from}, past its end)")
    return {
        "key": row["key"],
        "url": _text(row, "url"),
        "model_fingerprint": _text(row, "model_fingerprint"),
        "kv_format": _text(row, "kv_format"),
        "token_start": start,
        "token_end": end,
        "rows_from": rows_from,
        "bytes": _int(row, "bytes"),
        "created": _text(row, "created", optional=True),
        "last_used": _text(row, "last_used", optional=True),
    }
