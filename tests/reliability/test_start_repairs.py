"""Start-up repairs after real kills (SIGKILL) during a reply and during a save."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tampering import as_format

from sessions import paths, repair
from sessions.cachefiles import CacheIndex, ConversationCache, write_file
from sessions.conversations import ConversationStore
from sessions.db import DB_NAME, open_db

ROOT = Path(__file__).parents[2]

# A reply streamed as the engine streams one (a "streaming" message, a ReplyWriter that
# commits at least every second), from text that never ends: the kill always lands mid-reply.
CHILD_REPLIES = textwrap.dedent("""
    import contextlib, sys, time
    from sessions.conversations import ConversationStore, ReplyWriter
    from sessions.db import open_db
    from sessions.locks import conversation_lock

    store = ConversationStore(open_db())
    conversation = store.create("m")
    # As the service layer does: the turn holds the conversation's writer lock.
    lock = conversation_lock(conversation.id) if sys.argv[1] == "lock" else contextlib.nullcontext()
    with lock:
        user = store.add_message(conversation.id, "user", "Tell me a very long story.")
        reply = store.add_message(
            conversation.id, "assistant", "", parent_id=user.id, state="streaming"
        )
        writer = ReplyWriter(store, reply.id)
        n = 0
        while True:
            writer.append(f"word{n} ")
            n += 1
            time.sleep(0.001)
""")


def start_reply(lock: bool) -> tuple[subprocess.Popen, str]:
    """A child streaming a reply; returns once some of its text is committed."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_REPLIES, "lock" if lock else "no"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    db_path = paths.data_dir() / DB_NAME
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        time.sleep(0.2)
        try:
            rows = (
                sqlite3.connect(db_path)
                .execute(
                    "select content from messages where role = 'assistant' and state = 'streaming'"
                )
                .fetchall()
            )
        except sqlite3.OperationalError:  # not made yet
            continue
        if rows and rows[0][0]:
            return child, rows[0][0]
    child.kill()
    raise AssertionError(child.stderr.read().decode()[-2000:])


def the_reply() -> tuple[str, str]:
    [row] = open_db().execute("select state, content from messages where role = 'assistant'")
    return row


def test_a_reply_killed_mid_stream_is_marked_interrupted_with_its_text():
    child, seen = start_reply(lock=False)
    child.send_signal(signal.SIGKILL)
    child.wait()
    state, text = the_reply()
    assert state == "streaming" and text.startswith(seen)

    report = repair.on_start(open_db())
    assert report["interrupted_replies"] == 1
    assert the_reply() == ("interrupted", text)  # the text is kept as it was
    assert repair.on_start(open_db())["interrupted_replies"] == 0


def test_a_reply_still_streaming_in_another_process_is_left_alone():
    child, _ = start_reply(lock=True)
    try:
        assert repair.on_start(open_db())["interrupted_replies"] == 0
        assert the_reply()[0] == "streaming"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert repair.on_start(open_db())["interrupted_replies"] == 1  # its lock died with it
    assert the_reply()[0] == "interrupted"


CHILD_SAVES = textwrap.dedent("""
    import numpy as np
    from sessions.cachefiles import CacheIndex
    from sessions.chunkio import write_file
    from sessions.db import open_db

    index = CacheIndex(open_db())
    big = np.ones((1, 8, 4096, 1024), dtype=np.float16)  # 64 MiB: a save takes a while
    n = 0
    while True:  # save chunk after chunk, as kvstore does: file first, then its row
        key = f"{n:040x}"
        path = index.chunk_path(key)
        size = write_file(path, {"0.k.0": big}, {"model": "m", "key": key})
        index.add_chunk(key, path, size, "m", "float16", 0, 4096)
        n += 1
""")


def kill_during_a_save(attempts: int = 20) -> Path:
    """SIGKILL a saving child while its temp file exists; return that file."""
    root = CacheIndex(open_db()).root
    for _ in range(attempts):
        child = subprocess.Popen([sys.executable, "-c", CHILD_SAVES], cwd=ROOT)
        pattern = f".tmp-{child.pid}-*"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(root.rglob(pattern)):
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
        child.wait()
        left = list(root.rglob(pattern))
        if left:
            return left[0]
    raise AssertionError("never caught a save in progress")


def test_a_save_killed_midway_leaves_a_temp_file_that_start_up_removes():
    stray = kill_during_a_save()
    index = CacheIndex(open_db())
    # A live writer's temp file (this process's, just written) must survive the repair.
    live = index.root / "ff" / f".tmp-{os.getpid()}-{'f' * 40}.safetensors"
    live.parent.mkdir(parents=True, exist_ok=True)
    live.write_bytes(b"being written")

    report = repair.on_start(open_db())
    assert report["temp_files"] >= 1
    assert not stray.exists() and live.exists()
    assert not [p for p in index.root.rglob(".tmp-*") if p != live]
    assert index.verify() == []  # every indexed chunk is whole
    assert report["missing_rows"] == 0  # a row is never written before its file


def test_rows_whose_files_are_gone_are_dropped_and_old_formats_once(app_dirs):
    index = CacheIndex(open_db())
    keys = [c * 40 for c in "abc"]
    for key in keys:
        path = index.chunk_path(key)
        metadata = {"model": "m", "kv_format": "float16", "key": key}
        metadata |= {"token_start": "0", "token_end": "4"}
        write_file(path, {"0.k.0": np.zeros((1, 2, 4, 8), np.float16)}, metadata)
        index.add_chunk(key, path, path.stat().st_size, "m", "float16", 0, 4)
    index.set_conversation(ConversationCache(1, "m", "float16", [1, 2, 3, 4], 4, keys[:1]))
    index.chunk_path(keys[1]).unlink()  # evicted by hand, say
    # A file of the previous format (safetensors, CRC of the tensors only) under its row.
    save_file(
        {"0.k.0": np.zeros((1, 2, 4, 8), np.float16)},
        str(index.chunk_path(keys[2])),
        metadata={"reprise.format": "1", "checksum": "00000000"},
    )
    report = repair.on_start(open_db())
    assert report["missing_rows"] == 1 and report["old_format_chunks"] == 1
    assert index.chunk(keys[1]) is None and index.chunk(keys[2]) is None
    assert not index.chunk_path(keys[2]).exists()
    assert index.chunk(keys[0]) is not None and index.verify() == []
    assert repair.on_start(open_db()) == dict.fromkeys(report, 0)


def test_chunks_of_format_3_are_kept_as_they_are_still_read(app_dirs):
    """Format 4 reads format 3 files: a start after the upgrade keeps them (a save
    would otherwise write every saved conversation's cache again), and drops a file of
    a format it cannot read (a newer Reprise's)."""
    index = CacheIndex(open_db())
    keys = [c * 40 for c in "de"]
    for key, version in zip(keys, ("3", "5"), strict=True):
        path = index.chunk_path(key)
        metadata = {"model": "m", "kv_format": "float16", "key": key}
        metadata |= {"token_start": "0", "token_end": "4"}
        write_file(path, {"0-0.k.0": np.zeros((1, 1, 2, 4, 8), np.float16)}, metadata)
        index.add_chunk(key, path, path.stat().st_size, "m", "float16", 0, 4)
        as_format(index, key, version)
    report = repair.on_start(open_db())
    assert report["old_format_chunks"] == 1
    assert index.chunk(keys[0]) is not None and index.chunk_path(keys[0]).is_file()
    assert index.chunk(keys[1]) is None and not index.chunk_path(keys[1]).exists()
    assert index.verify() == []


def test_repairs_keep_every_message(app_dirs):
    store = ConversationStore(open_db())
    conversation = store.create("m")
    user = store.add_message(conversation.id, "user", "hello")
    reply = store.add_message(
        conversation.id, "assistant", "half a rep", parent_id=user.id, state="streaming"
    )
    repair.on_start(open_db())
    messages = store.get(conversation.id).messages
    assert [(m.role, m.content) for m in messages] == [
        ("user", "hello"),
        ("assistant", "half a rep"),
    ]
    assert store.message(reply.id).state == "interrupted"
