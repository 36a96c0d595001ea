"""Index rows and URLs damaged with raw SQL and real files: every one is a typed
rejection (the caller recomputes) or skipped, never an exception. No model needed."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from sessions.cachefiles import (
    CacheIndex,
    CacheRejected,
    ConversationCache,
    write_file,
)
from sessions.chunkio import advise_reading
from sessions.db import open_db

KEYS = ["ab" * 20, "cd" * 20]
TOKENS = list(range(1, 25))
CHUNK = 16
EXPECT = {"model": "fp"}


def chunk_tensors(start: int, end: int) -> dict[str, np.ndarray]:
    return {"0.k.0": np.full((1, 2, end - start, 4), start, dtype=np.float16)}


@pytest.fixture
def index() -> CacheIndex:
    index = CacheIndex(open_db())
    for key, start in zip(KEYS, (0, CHUNK), strict=True):
        end = min(start + CHUNK, len(TOKENS))
        path = index.chunk_path(key)
        size = write_file(path, chunk_tensors(start, end), {**EXPECT, "key": key})
        index.add_chunk(key, path, size, "fp", "float16", start, end)
    index.set_conversation(ConversationCache(7, "fp", "float16", TOKENS, CHUNK, KEYS))
    return index


def sql(index: CacheIndex, statement: str, *args) -> None:
    index.db.execute(statement, list(args))
    index.db.conn.commit()


def test_intact_rows_read_back(index):
    entry = index.checked_conversation(7)
    assert entry.tokens == TOKENS and entry.chunk_keys == KEYS and entry.chunk_tokens == CHUNK
    tensors, _, row = index.read_chunk(KEYS[1], {**EXPECT, "key": KEYS[1]})
    assert row["bytes"] == index.chunk_path(KEYS[1]).stat().st_size
    assert np.array_equal(tensors["0.k.0"], chunk_tensors(CHUNK, len(TOKENS))["0.k.0"])


def test_chunks_touched_by_a_restore_outlive_older_ones_at_eviction(index):
    """The chunk written first but read since is the one kept: eviction goes by use."""
    index.touch([KEYS[0]])
    size = index.chunk(KEYS[0])["bytes"]
    index.evict_to_budget(size)
    assert index.chunk(KEYS[0]) is not None and index.chunk(KEYS[1]) is None
    touched = index.chunk(KEYS[0])["last_used"]
    index.touch([KEYS[0]])
    assert index.chunk(KEYS[0])["last_used"] > touched  # committed, as a new connection sees
    assert CacheIndex(open_db()).chunk(KEYS[0])["last_used"] > touched


DEEP = "[" * 50_000 + "]" * 50_000
CONVERSATION_DAMAGE = {
    "tokens NULL": ("tokens = NULL",),
    "tokens text": ("tokens = 'one two three'",),
    "tokens an integer": ("tokens = 12",),
    "tokens of 3 bytes": ("tokens = x'010203'",),
    "tokens empty": ("tokens = zeroblob(0)",),
    "a negative token": ("tokens = x'ffffffff'",),
    "chunk_keys NULL": ("chunk_keys = NULL",),
    "chunk_keys not JSON": ("chunk_keys = '[\"ab'",),
    "chunk_keys an object": ("chunk_keys = '{\"a\": 1}'",),
    "chunk_keys numbers": ("chunk_keys = '[1, 2]'",),
    "chunk_keys a path": ('chunk_keys = \'["../../etc/passwd", "cd"]\'',),
    "chunk_keys empty": ("chunk_keys = '[]'",),
    "chunk_keys too few": (f"chunk_keys = '[\"{KEYS[0]}\"]'",),
    "chunk_keys nested deep": ("chunk_keys = ?", DEEP),
    "chunk_keys a blob": ("chunk_keys = x'00ff'",),
    "checkpoint_keys not JSON": ("checkpoint_keys = '[\"ab'",),
    "checkpoint_keys numbers": ("checkpoint_keys = '[1]'",),
    "checkpoint_keys a path": ("checkpoint_keys = '[\"../../etc/passwd\"]'",),
    "checkpoint_keys a blob": ("checkpoint_keys = x'00ff'",),
    "checkpoint_keys nested deep": ("checkpoint_keys = ?", DEEP),
    "checkpoints with no chunk length": (f"chunk_tokens = 0, checkpoint_keys = '[\"{KEYS[0]}\"]'",),
    "chunk_tokens NULL": ("chunk_tokens = NULL",),
    "chunk_tokens text": ("chunk_tokens = 'sixteen'",),
    "chunk_tokens negative": ("chunk_tokens = -16",),
    "chunk_tokens fractional": ("chunk_tokens = 2.5",),
    "model NULL": ("model_fingerprint = NULL",),
    "model a blob": ("model_fingerprint = x'00'",),
    "kv_format NULL": ("kv_format = NULL",),
    "kv_format empty": ("kv_format = ''",),
    "kv_format huge": ("kv_format = ?", "q" * 100_000),
}


@pytest.mark.parametrize("damage", CONVERSATION_DAMAGE)
def test_a_damaged_conversation_row_is_a_rejection(index, damage):
    assignment, *args = CONVERSATION_DAMAGE[damage]
    sql(index, f"update conversation_caches set {assignment} where conversation_id = 7", *args)
    with pytest.raises(CacheRejected, match="damaged index row"):
        index.checked_conversation(7)
    assert index.conversation(7) is None  # what the engine asks: "no saved cache"
    # Everything that reads every row goes on around it.
    assert index.conversations_summary() == []
    assert index.referenced_keys() == set()
    assert index.usage()[0] == 2
    # A save of another chat asks who else may hold its chunks: a damaged row may hold any.
    [(keys, _)] = index.other_caches(8)
    assert keys is None or all(isinstance(key, str) for key in keys)
    # Eviction asks which keys are checkpoints, to take a chat's files from its end.
    index.evict_to_budget(index.usage()[1] - 1)
    assert index.usage()[0] == 1
    assert index.collect_garbage(orphan_age=0)["damaged_entries"] == 1
    assert index.conversation(7) is None and index.usage() == (0, 0)


def test_a_damaged_table_is_a_rejection_or_no_cache(index):
    sql(index, "alter table conversation_caches drop column chunk_keys")
    with pytest.raises(CacheRejected, match="damaged index row"):
        index.checked_conversation(7)
    sql(index, "drop table conversation_caches")
    assert index.conversation(7) is None


def _replace_file(index: CacheIndex, tmp_path: Path, how: str) -> None:
    path = index.chunk_path(KEYS[0])
    path.unlink()
    if how == "a symlink loop":
        path.symlink_to(path)
    elif how == "a symlink outside the root":
        outside = tmp_path / "outside.safetensors"  # a perfectly good file, elsewhere
        write_file(outside, chunk_tensors(0, CHUNK), {**EXPECT, "key": KEYS[0]})
        path.symlink_to(outside)
    elif how == "a folder":
        path.mkdir()
    elif how == "a FIFO":  # opening one for reading would wait for a writer forever
        os.mkfifo(path)
    elif how == "a symlink to another chunk":
        path.symlink_to(index.chunk_path(KEYS[1]))


ROOT_URL = "file://{root}/ab/"
CHUNK_DAMAGE = {
    "url NULL": ("url = NULL",),
    "url a number": ("url = 42",),
    "url a blob": ("url = x'66696c65'",),
    "url with an escaped NUL": ("url = url || '%00.x'",),
    "url with a NUL": ("url = url || char(0) || 'x'",),
    "url with an over-long name": ("url = ?", "file:///tmp/" + "n" * 300),
    "url over-long": ("url = ?", "file:///" + "a/" * 3000),
    "url http": ("url = 'http://example.com/x.safetensors'",),
    "url on another host": ("url = 'file://server/share/x.safetensors'",),
    "url outside the root": ("url = 'file:///etc/hostname'",),
    "url climbing out": ("url = url || '/../../../../../../../etc/passwd'",),
    "url with a query": ("url = url || '?x=1'",),
    "url broken": ("url = 'file://[/x'",),
    "url another chunk": ("url = (select url from cache_chunks where key = ?)", KEYS[1]),
    "bytes NULL": ("bytes = NULL",),
    "bytes text": ("bytes = 'many'",),
    "bytes negative": ("bytes = -5",),
    "bytes wrong": ("bytes = bytes + 1",),
    "token_start NULL": ("token_start = NULL",),
    "token_end before start": ("token_end = -1",),
    "rows_from text": ("rows_from = 'soon'",),
    "rows_from before its start": ("rows_from = token_start - 1",),
    "rows_from past its end": ("rows_from = token_end + 1",),
}


@pytest.mark.parametrize("damage", [*CHUNK_DAMAGE, "key not hex"])
def test_a_damaged_chunk_row_is_a_rejection_and_is_dropped(index, damage):
    if damage == "key not hex":
        sql(index, "update cache_chunks set key = '../x' where key = ?", KEYS[0])
    else:
        assignment, *args = CHUNK_DAMAGE[damage]
        sql(index, f"update cache_chunks set {assignment} where key = ?", *args, KEYS[0])
    row = index.chunk(KEYS[0])
    assert row is None or isinstance(row["bytes"], int)
    assert index.chunks(KEYS) == {k: r for k in KEYS if (r := index.chunk(k))}  # a restore's
    with pytest.raises(CacheRejected) as rejected:
        index.read_chunk(KEYS[0], {**EXPECT, "key": KEYS[0]})
    assert rejected.value.reason
    # Nothing that reads every row raises, and the rest of the cache still works.
    index.verify()
    count, size = index.usage()
    assert isinstance(count, int) and isinstance(size, int)
    index.conversations_summary()
    index.evict_to_budget(10**9)
    index.read_chunk(KEYS[1], {**EXPECT, "key": KEYS[1]})
    # The damaged chunk is gone, so the next save writes it anew.
    assert index.chunk(KEYS[0]) is None
    assert KEYS[1] in {key for key, _ in index.chunk_rows()}
    assert Path("/etc/hostname").exists() or damage != "url outside the root"


@pytest.mark.parametrize(
    "how",
    [
        "a symlink loop",
        "a symlink outside the root",
        "a folder",
        "a FIFO",
        "a symlink to another chunk",
        "missing",
    ],
)
def test_something_other_than_the_file_at_its_path_is_a_rejection(index, tmp_path, how):
    _replace_file(index, tmp_path, how)
    advise_reading([index.chunk_path(key) for key in KEYS])  # a hint: never waits nor raises
    with pytest.raises(CacheRejected):
        index.read_chunk(KEYS[0], {**EXPECT, "key": KEYS[0]})
    assert index.chunk(KEYS[0]) is None
    index.verify()
    index.collect_garbage(orphan_age=0)
    assert (tmp_path / "outside.safetensors").exists() or how != "a symlink outside the root"


def test_gc_and_eviction_never_delete_outside_the_root(index, tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    sql(index, "update cache_chunks set url = ? where key = ?", victim.as_uri(), KEYS[0])
    index.evict_to_budget(0)
    index.clear()
    assert victim.read_text() == "keep me"


def test_summary_counts_only_what_is_readable(index):
    [summary] = index.conversations_summary()
    assert summary["tokens"] == len(TOKENS)
    assert summary["chunks"] == summary["chunks_on_disk"] == math.ceil(len(TOKENS) / CHUNK)
    sql(index, "update cache_chunks set bytes = 'x' where key = ?", KEYS[1])
    [summary] = index.conversations_summary()
    assert summary["chunks_on_disk"] == 1


def test_a_long_chats_rows_are_read_together_as_one_by_one(index):
    """A restore reads its rows in one query (in parts, under SQLite's limit on a
    statement's variables): the same rows `chunk` gives, none for a missing key."""
    keys = [f"{n:040x}" for n in range(1, 1201)]
    path = index.chunk_path(KEYS[0])
    for n, key in enumerate(keys):
        index.add_chunk(key, path, 10, "fp", "float16", n, n + 1)
    wanted = [*keys, "ef" * 20, KEYS[1]]
    found = index.chunks(wanted)
    assert set(found) == {*keys, KEYS[1]}
    assert all(found[key] == index.chunk(key) for key in (keys[0], keys[777], KEYS[1]))
