"""`reprise chat --conversation` killed for real (SIGKILL) at random points of a reply and
of a cache save, then a new `reprise chat` on the same conversation: it opens, the reply
cut short is marked "interrupted" with the text it had (a prefix of the reply the same
turn gives when not killed), no temp file is left, every indexed chunk is whole, and the
next turn answers.

test_start_repairs.py checks the repairs themselves against stand-in writers; this file
runs the real command. REPRISE_KILL_TRIALS sets the number of kills of each kind (default
3), REPRISE_KILL_SEED the random seed (printed with every failure)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from sessions import paths
from sessions.cachefiles import CacheIndex
from sessions.conversations import ConversationStore
from sessions.db import DB_NAME, open_db

REPRISE = str(Path(sys.executable).with_name("reprise"))
TRIALS = int(os.environ.get("REPRISE_KILL_TRIALS", "3"))
SEED = int(os.environ.get("REPRISE_KILL_SEED", str(random.randrange(1 << 30))))
# A greedy turn of the tiny random model that runs ~650 tokens before it stops: long
# enough that a random kill often lands while it streams.
MESSAGE = "hello"
TURN = ("--max-tokens", "1500", "--temp", "0", "--json")
NEXT_TURN = ("--max-tokens", "3", "--temp", "0", "--json", "and then?")

# The real command, in a process that SIGKILLs itself during its cache save, at the n-th
# chunk file: as its temp file is opened (nothing written yet), as the finished temp file
# is renamed into place (written and synced, not yet the chunk), or a random few ms after
# the open (writing, syncing, renaming, the index rows, the next chunk), whatever the
# machine's speed. Python's audit events mark those moments.
KILLED_IN_SAVE = textwrap.dedent("""
    import os, signal, sys, threading
    nth, moment, delay_s = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    seen = {"open": 0, "os.rename": 0}

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    def on_event(event, args):
        if event not in seen or ".tmp-" not in str(args[0]):
            return
        if not str(args[0]).endswith(".safetensors"):
            return
        seen[event] += 1
        if seen[event] != nth:
            return
        if moment == event:
            kill()
        elif moment == "later" and event == "open":
            threading.Timer(delay_s, kill).start()

    sys.addaudithook(on_event)
    from app.cli import main
    sys.exit(main(sys.argv[4:]))
""")
SAVE_MOMENTS = ("open", "os.rename", "later")


def chat_args(model: Path, conversation: str, message: str = MESSAGE) -> list[str]:
    return ["chat", "--model", str(model), "--conversation", conversation, *TURN, message]


def replies() -> list[tuple[str, str]]:
    db = open_db(read_only=True)
    return [
        (row["state"], row["content"])
        for row in db["messages"].rows_where("role = 'assistant'", order_by="id")
    ]


def leftover_temp_files() -> list[Path]:
    return [p for p in CacheIndex(open_db(read_only=True)).root.rglob(".tmp-*")]


def next_turn_works(conversation_id: int | None, model: Path, why: str) -> dict:
    """A new process continues the conversation (or starts one, if none was stored);
    then the state on disk is whole."""
    conversation = "new" if conversation_id is None else str(conversation_id)
    done = subprocess.run(
        [REPRISE, "chat", "--model", str(model), "--conversation", conversation, *NEXT_TURN],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"{why}: {done.stderr[-2000:]}"
    turn = json.loads(done.stdout)
    assert turn["generated_tokens"] >= 1, why
    assert conversation_id in (None, turn["conversation_id"]), why
    assert leftover_temp_files() == [], why
    assert CacheIndex(open_db(read_only=True)).verify() == [], why
    states = [state for state, _ in replies()]
    assert "streaming" not in states and states[-1] == "complete", f"{why}: {states}"
    return turn


@pytest.fixture
def fresh_dirs(tmp_path, monkeypatch):
    """A data and a cache folder of its own for each trial."""
    count = 0

    def make() -> None:
        nonlocal count
        count += 1
        for name in ("data", "cache"):
            monkeypatch.setenv(f"REPRISE_{name.upper()}_DIR", str(tmp_path / f"{count}" / name))

    return make


REPLIES = "select state, length(content) from messages where role = 'assistant'"


def reply_states() -> list[tuple[str, int]]:
    """The replies' states and lengths, read as another process would (the database may
    not be made yet)."""
    db_path = paths.data_dir() / DB_NAME
    with (
        contextlib.suppress(sqlite3.OperationalError),
        contextlib.closing(sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)) as db,
    ):
        return list(db.execute(REPLIES))
    return []


def wait_for_reply(child: subprocess.Popen, until: str, deadline_s: float = 300) -> bool:
    """Wait until the child's reply has its first words in the database (`until="words"`)
    or has stopped streaming (`until="end"`); whether that came before the child exited."""
    started = time.monotonic()
    while time.monotonic() - started < deadline_s and child.poll() is None:
        for state, length in reply_states():
            if length > 0 if until == "words" else state != "streaming":
                return True
        time.sleep(0.01)
    assert child.poll() is not None, f"the reply never reached {until!r}"
    return False


def test_a_reply_killed_at_random_points(tiny_model_dir, fresh_dirs):
    """One run unkilled gives the reply, how long the start takes and how long the reply
    streams; then a third of the kills land at a random moment of the start (imports,
    model, database, prompt), the rest a random moment into the streaming."""
    rng = random.Random(SEED)
    fresh_dirs()
    whole = subprocess.Popen(
        [REPRISE, *chat_args(tiny_model_dir, "new")], stdout=subprocess.PIPE, text=True
    )
    started = time.monotonic()
    assert wait_for_reply(whole, until="words")
    start_s = time.monotonic() - started
    assert wait_for_reply(whole, until="end")
    stream_s = time.monotonic() - started - start_s
    reference = json.loads(whole.communicate(timeout=300)[0])["reply"]
    assert whole.returncode == 0 and len(reference) > 200  # a reply long enough to cut

    outcomes: Counter[str] = Counter()
    for trial in range(TRIALS):
        fresh_dirs()
        child = subprocess.Popen(
            [REPRISE, *chat_args(tiny_model_dir, "new")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        if trial % 3 == 0:
            delay_s = rng.uniform(0, start_s)
            at = f"{delay_s:.2f} s after the start"
        else:
            wait_for_reply(child, until="words")
            delay_s = rng.uniform(0, stream_s * 0.9)
            at = f"{delay_s:.2f} s into a reply that streams for {stream_s:.2f} s"
        time.sleep(delay_s)
        child.send_signal(signal.SIGKILL)
        child.wait()
        why = f"seed {SEED}, trial {trial}, killed {at}"
        outcomes[_check_after_a_kill(reference, tiny_model_dir, why)] += 1
    print(f"reply kills (seed {SEED}): {dict(outcomes)}")


def _check_after_a_kill(reference: str, model: Path, why: str) -> str:
    """What the kill cut, checked; then the next turn on the conversation."""
    conversations = [c.id for c in ConversationStore(open_db()).list()]
    if not conversations:  # killed while starting: nothing stored, a new chat works
        next_turn_works(None, model, why)
        return "before the conversation was stored"
    before = replies()
    [conversation_id] = conversations
    next_turn_works(conversation_id, model, why)
    after = replies()
    if not before:
        return "before the reply began"
    [(state_then, text)] = before
    assert after[0][1] == text, f"{why}: the kept text changed"
    assert reference.startswith(text), f"{why}: {text[-80:]!r} is not what was streamed"
    if state_then == "streaming":
        assert after[0][0] == "interrupted", why
        return "mid-reply: marked interrupted"
    assert state_then == "complete" and text == reference, why
    return "after the reply: complete"


def test_a_save_killed_at_random_points(tiny_model_dir, fresh_dirs):
    rng = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    for trial in range(TRIALS):
        nth, moment, delay_s = rng.randint(1, 3), SAVE_MOMENTS[trial % 3], rng.uniform(0, 0.03)
        why = f"seed {SEED}, trial {trial}: chunk {nth}, at {moment} ({delay_s * 1000:.1f} ms)"
        fresh_dirs()
        killed = subprocess.run(
            [
                sys.executable,
                "-c",
                KILLED_IN_SAVE,
                str(nth),
                moment,
                str(delay_s),
                *chat_args(tiny_model_dir, "new"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        left = "a temp file left" if leftover_temp_files() else "no temp file left"
        if killed.returncode == 0:
            outcomes[f"the save ended before chunk {nth}"] += 1
        else:
            assert killed.returncode == -signal.SIGKILL, f"{why}: {killed.stderr[-2000:]}"
            outcomes[f"killed at {moment}: {left}"] += 1
            if moment == "os.rename":
                assert left == "a temp file left", why
        [(state, _)] = replies()
        assert state == "complete", why  # the reply is stored before its cache is saved
        [conversation] = ConversationStore(open_db()).list()
        turn = next_turn_works(conversation.id, tiny_model_dir, why)
        assert turn["restore_source"] in ("memory", "disk", "recompute"), why
    print(f"save kills (seed {SEED}): {dict(outcomes)}")
