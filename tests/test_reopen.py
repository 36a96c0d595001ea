"""Stored conversations across real processes, on the starter model."""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings
from sessions import paths
from sessions.cachefiles import CacheIndex
from sessions.conversations import ConversationStore
from sessions.db import open_db

REPRISE = str(Path(sys.executable).with_name("reprise"))
ROOT = Path(__file__).parents[1]


def chat(model_dir, conversation, message, max_tokens=16) -> dict:
    done = subprocess.run(
        [
            REPRISE,
            "chat",
            "--model",
            str(model_dir),
            "--conversation",
            conversation,
            "--temp",
            "0",
            "--repetition-penalty",  # plain greedy, as the comparison computes it
            "1",
            "--max-tokens",
            str(max_tokens),
            "--json",
            message,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_conversation_reopened_in_a_new_process_resumes_from_disk(
    starter_model_dir, starter_model
):
    first = chat(starter_model_dir, "new", "What is the capital of France?")
    conversation = str(first["conversation_id"])
    assert first["restore_source"] == "recompute"
    second = chat(starter_model_dir, conversation, "What about Germany?")
    assert second["restore_source"] == "disk"

    saved = CacheIndex(open_db()).conversation(int(conversation)).tokens
    fourth = chat(starter_model_dir, conversation, "Name a river in one of them.")
    assert fourth["restore_source"] == "disk"
    assert fourth["cache_rejected"] is None
    # All of the saved history is reused; only the new message is prefilled.
    assert fourth["reused_tokens"] == len(saved)
    new_message = starter_model.tokenizer.encode(
        "Name a river in one of them.", add_special_tokens=False
    )
    assert len(new_message) < fourth["prefilled_tokens"] <= len(new_message) + 12

    # The greedy reply after reopening equals the one computed with no cache.
    messages = ConversationStore(open_db()).get(int(conversation)).chat_messages()[:-1]
    *_, fresh = ChatSession(starter_model).reply(messages, sampling=SamplingSettings.greedy(16))
    assert fourth["reply"] == fresh.text

    assert (
        subprocess.run([REPRISE, "cache", "verify"], capture_output=True, check=False).returncode
        == 0
    )


CHILD_SAVES_FOREVER = textwrap.dedent("""
    import sys
    import app.engine
    from pathlib import Path
    from app.engine.loading import load
    from app.engine.conversation import ConversationEngine, TurnOptions
    from app.engine.generation import SamplingSettings
    from sessions.db import open_db

    engine = ConversationEngine(open_db(), load(Path(sys.argv[1])), chunk_tokens=64)
    conversation = engine.store.create(engine.loaded.name)
    text = open(sys.argv[2]).read()
    list(engine.send(conversation.id, text, TurnOptions(sampling=SamplingSettings.greedy(8))))
    print(conversation.id, flush=True)
    while True:  # rewrite every chunk, again and again, until killed
        for key in engine.index.conversation(conversation.id).chunk_keys:
            engine.index.delete_chunk(key)
        engine.save(conversation.id)
""")


def test_kill_during_a_save_leaves_a_usable_database_and_no_torn_cache(
    starter_model_dir, starter_model
):
    text_file = ROOT / "resources/text/ordinary-english.txt"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_SAVES_FOREVER, str(starter_model_dir), str(text_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    conversation_id = int(child.stdout.readline())
    time.sleep(1.3)
    child.send_signal(signal.SIGKILL)
    child.wait()

    db = open_db()
    index = CacheIndex(db)
    assert db.execute("pragma integrity_check").fetchone()[0] == "ok"
    assert index.verify() == []  # every indexed file is whole
    index.collect_garbage()
    assert not list(index.root.rglob(".tmp-*"))

    # The conversation continues: from what survived on disk, or by recomputing.
    from app.engine.conversation import ConversationEngine, TurnOptions

    engine = ConversationEngine(db, starter_model, chunk_tokens=64)
    events = list(
        engine.send(
            conversation_id,
            "Summarise that in one line.",
            TurnOptions(sampling=SamplingSettings.greedy(20)),
        )
    )
    finished = events[-2]
    assert finished.restore.source in ("disk", "recompute")
    messages = engine.store.get(conversation_id).chat_messages()[:-1]
    *_, fresh = ChatSession(starter_model).reply(messages, sampling=SamplingSettings.greedy(20))
    assert finished.text == fresh.text


CHILD_STREAMS = textwrap.dedent("""
    import sys
    import app.engine
    from pathlib import Path
    from app.engine.loading import load
    from app.engine.conversation import ConversationEngine, TurnOptions
    from app.engine.generation import SamplingSettings
    from sessions.db import open_db

    engine = ConversationEngine(open_db(), load(Path(sys.argv[1])))
    conversation = engine.store.create(engine.loaded.name)
    options = TurnOptions(sampling=SamplingSettings.greedy(3000))
    for event in engine.send(conversation.id, "Tell me a very long story.", options):
        pass
""")


def test_kill_mid_reply_keeps_the_text_streamed_before_the_last_second(starter_model_dir):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD_STREAMS, str(starter_model_dir)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
    )
    db_path = paths.data_dir() / "reprise.db"
    query = "select content from messages where role = 'assistant'"
    deadline = time.monotonic() + 120
    seen = ""
    while time.monotonic() < deadline and len(seen) < 40:
        time.sleep(0.2)
        if db_path.exists():
            try:
                rows = sqlite3.connect(db_path).execute(query).fetchall()
            except sqlite3.OperationalError:  # the schema is still being made
                continue
            seen = rows[0][0] if rows else ""
    assert len(seen) >= 40, child.stderr.read() if child.poll() is not None else "no text yet"
    time.sleep(1.5)
    child.kill()
    child.wait()

    conversation = ConversationStore(open_db()).list()[0]
    messages = ConversationStore(open_db()).get(conversation.id).messages
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[0].content == "Tell me a very long story."
    reply = messages[1]
    assert reply.state == "streaming"  # it never finished
    # What was committed 1.5 s ago is still there and has grown since (saved at least every second).
    assert reply.content.startswith(seen) and len(reply.content) > len(seen)


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48k", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(mount))
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_loses_no_text(tiny_model, small_disk):
    from app.engine.conversation import CacheSaved, ConversationEngine, TurnOptions

    engine = ConversationEngine(open_db(), tiny_model, chunk_tokens=16)
    conversation = engine.store.create(tiny_model.name)
    options = TurnOptions(sampling=SamplingSettings.greedy(60))
    saved = None
    for text in ("fill the disk please " * 4, "and more " * 10, "still here?"):
        events = list(engine.send(conversation.id, text, options))
        saved = next(e for e in events if isinstance(e, CacheSaved))
        if saved.error:
            break
    assert saved.error and "disk is full" in saved.error
    assert not [p for p in small_disk.rglob(".tmp-*")]  # no half-written file is left
    messages = engine.store.get(conversation.id).messages
    assert all(m.state == "complete" for m in messages) and messages[-1].role == "assistant"
    assert CacheIndex(open_db()).verify() == []
