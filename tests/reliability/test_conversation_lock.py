"""One writer per conversation, across real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sessions.conversations import ConversationStore
from sessions.db import open_db
from sessions.locks import ConversationBusy, conversation_lock, is_locked

ROOT = Path(__file__).parents[2]

HOLDER = textwrap.dedent("""
    import sys, time
    from sessions.locks import conversation_lock

    with conversation_lock(int(sys.argv[1])):
        print("held", flush=True)
        time.sleep(120)
""")


def hold(conversation_id: int) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(conversation_id)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "held"
    return child


def test_a_second_process_is_refused_with_the_holders_pid():
    child = hold(3)
    try:
        with pytest.raises(ConversationBusy) as busy, conversation_lock(3):
            pass
        assert str(busy.value).startswith(
            f"Conversation 3 is open in another Reprise window or terminal (pid {child.pid})"
        )
        assert is_locked(3)
        with conversation_lock(4):  # other conversations are free
            pass
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    # kill -9 leaves no stale lock: the kernel drops it with its holder.
    assert not is_locked(3)
    with conversation_lock(3):
        assert is_locked(3)


def test_the_same_process_cannot_take_it_twice():
    with conversation_lock(5), pytest.raises(ConversationBusy), conversation_lock(5):
        pass
    with conversation_lock(5):
        pass


APPENDER = textwrap.dedent("""
    import sys, time
    from sessions.conversations import ConversationStore
    from sessions.db import open_db
    from sessions.locks import ConversationBusy, conversation_lock

    store = ConversationStore(open_db())
    conversation_id, name = int(sys.argv[1]), sys.argv[2]
    turns = refused = 0
    while turns < 8:
        try:
            with conversation_lock(conversation_id):
                # A turn: read the stored history, "generate" from it, store the reply.
                history = store.get(conversation_id).messages
                leaf = history[-1].id if history else None
                user = store.add_message(conversation_id, "user", name, parent_id=leaf)
                time.sleep(0.1)
                seen = len(history)
                store.add_message(
                    conversation_id, "assistant", f"{name} saw {seen}", parent_id=user.id
                )
                turns += 1
        except ConversationBusy:
            refused += 1
            time.sleep(0.01)
    print(refused, flush=True)
""")


def test_two_processes_appending_each_reply_from_the_stored_history():
    store = ConversationStore(open_db())
    conversation = store.create("m")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", APPENDER, str(conversation.id), name],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name in ("left", "right")
    ]
    refusals = [int(child.communicate(timeout=120)[0]) for child in children]
    assert all(child.returncode == 0 for child in children)
    assert sum(refusals) > 0  # they did meet
    messages = ConversationStore(open_db()).get(conversation.id).messages
    assert len(messages) == 32
    # Every reply was generated from exactly the history stored before its message.
    for n in range(0, 32, 2):
        user, reply = messages[n], messages[n + 1]
        assert (user.role, reply.role) == ("user", "assistant")
        assert reply.content == f"{user.content} saw {n}"


def test_a_lock_file_removed_as_it_was_locked_is_not_held_for_the_name(monkeypatch):
    """Review: a writer that had opened the lock file just before a deletion removed it,
    then locked it, held a file no other writer would see; a chat given the id again got
    a second writer, locking the name's new file. Here that interleaving is forced: the
    deletion runs between the first writer's open and its lock."""
    from sessions import locks

    real_flock = locks.fcntl.flock
    deleted: list[bool] = []

    def flock(fd, operation):
        if not deleted:  # the first writer has the file open, not yet locked
            deleted.append(True)
            with conversation_lock(2) as deleting:
                deleting.discard()
        return real_flock(fd, operation)

    monkeypatch.setattr(locks.fcntl, "flock", flock)
    with conversation_lock(2):
        assert deleted and locks.lock_path(2).exists()
        with pytest.raises(ConversationBusy), conversation_lock(2):  # the next writer waits
            pass
