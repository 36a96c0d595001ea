"""`ChatService`, the one writer: its use cases on a real database, real files and
the tiny model, and garbage collection run by another process mid-save."""

from __future__ import annotations

import subprocess
import sys

import pytest
from test_cli import REPRISE

from app.service.chat import ChatService
from app.service.preferences import Preferences
from sessions import paths
from sessions.conversations import NotFound
from sessions.db import open_db
from sessions.locks import ConversationBusy, conversation_lock, lock_path


@pytest.fixture
def service(tiny_model_dir) -> ChatService:
    (paths.models_dir() / tiny_model_dir.name).symlink_to(tiny_model_dir)
    service = ChatService(open_db())
    service.save_preferences(
        Preferences(model=tiny_model_dir.name, temperature=0.0, max_tokens=6, kv_group_size=32)
    )
    return service


def reply(service, conversation_id, text):
    events = list(service.send(conversation_id, text))
    return events[-2], events[-1]  # ReplyFinished, CacheSaved


def new_conversation(service) -> int:
    return service.create_conversation(service.load_model().loaded.name).id


def files_on_disk(service) -> set[str]:
    return {p.stem for p in service.index.root.rglob("*.safetensors")}


def gc_in_another_process() -> None:
    done = subprocess.run([REPRISE, "cache", "gc"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_gc_from_another_process_during_a_save_loses_nothing(service):
    """A terminal's `reprise cache gc` run between a chunk file and its row, and
    between the rows and the conversation that uses them: the save stands."""
    conversation = new_conversation(service)
    index = service.load_model().kvstore.index
    add_chunk, set_conversation = index.add_chunk, index.set_conversation
    ran = []

    def add_chunk_after_gc(*args, **kwargs):  # the file is written, its row is not
        gc_in_another_process()
        ran.append("before row")
        return add_chunk(*args, **kwargs)

    def point_after_gc(*args, **kwargs):  # the rows are in, nothing uses them yet
        gc_in_another_process()
        ran.append("before use")
        return set_conversation(*args, **kwargs)

    index.add_chunk, index.set_conversation = add_chunk_after_gc, point_after_gc
    _, saved = reply(service, conversation, "a message long enough to make a few chunks")
    index.add_chunk, index.set_conversation = add_chunk, set_conversation
    assert saved.error is None and saved.report.chunks_written >= 1
    assert "before row" in ran and "before use" in ran
    assert index.verify() == []
    entry = index.conversation(conversation)
    assert set(entry.chunk_keys) <= files_on_disk(service)

    reopened = ChatService(open_db())  # as after a restart
    finished, _ = reply(reopened, conversation, "and again")
    assert finished.restore.source == "disk", finished.restore.rejected


def test_delete_removes_the_conversation_and_only_its_files(service):
    kept, gone = new_conversation(service), new_conversation(service)
    reply(service, kept, "the first chat")
    reply(service, gone, "a different second chat")
    kept_files = set(service.index.conversation(kept).chunk_keys)
    service.delete(gone)
    with pytest.raises(NotFound):
        service.store.get(gone)
    assert service.index.conversation(gone) is None
    assert files_on_disk(service) == kept_files
    # A chat that was written to leaves a lock file; a deleted one leaves nothing behind.
    assert lock_path(kept).exists() and not lock_path(gone).exists()


def test_clear_caches_keeps_every_message(service):
    conversation = new_conversation(service)
    reply(service, conversation, "hello there")
    service.clear_caches()
    assert files_on_disk(service) == set()
    assert [m.role for m in service.store.get(conversation).messages] == ["user", "assistant"]
    finished, _ = reply(ChatService(open_db()), conversation, "still here?")
    assert finished.restore.source == "recompute" and finished.text


def test_rename_and_branches(service):
    conversation = new_conversation(service)
    first, _ = reply(service, conversation, "name a colour")
    service.rename(conversation, "  Colours  ")
    assert service.store.get(conversation).title == "Colours"
    second = list(service.regenerate(conversation))[-2]
    service.select_branch(conversation, first.message_id)
    assert service.store.get(conversation).messages[-1].id == first.message_id
    assert second.message_id != first.message_id


def test_a_conversation_written_elsewhere_is_refused_not_interleaved(service):
    conversation = new_conversation(service)
    with conversation_lock(conversation), pytest.raises(ConversationBusy, match="another"):
        reply(service, conversation, "hello")
    assert service.store.get(conversation).messages == []


def test_a_chat_of_its_own_system_prompt_is_read_before_the_default(service):
    """The default from Preferences serves every chat without one; a chat's own prompt
    replaces it for that chat only, and clearing it brings the default back."""
    from dataclasses import replace

    service.save_preferences(replace(service.preferences(), system_prompt="Default prompt."))
    tokenizer = service.load_model().loaded.tokenizer
    own, other = new_conversation(service), new_conversation(service)
    service.set_system_prompt(own, "  This chat's prompt.  ")
    assert service.store.get(own).system_prompt == "This chat's prompt."

    def seen() -> str:  # what the model read in the last turn
        return tokenizer.decode(service.engine.session.tokens, skip_special_tokens=False)

    reply(service, own, "hello")
    assert "This chat's prompt." in seen() and "Default prompt." not in seen()
    reply(service, other, "hello")
    assert "Default prompt." in seen()
    service.set_system_prompt(own, "")
    assert service.store.get(own).system_prompt is None
    reply(service, own, "again")
    assert "Default prompt." in seen() and "This chat's prompt." not in seen()


COUNT_A_LONG_DRAFT = """
import sys
import app.engine
from app.engine.loading import load
tokenizer = load(sys.argv[1]).tokenizer
print(len(tokenizer.encode("word " * 10_000)))
"""


def test_counting_a_draft_longer_than_the_context_writes_nothing_to_stderr(starter_model_dir):
    """Found on a new-user walk: the meter counting a pasted text too long for the context
    had transformers warn on stderr of "indexing errors" (the draft is counted, never fed)."""
    done = subprocess.run(
        [sys.executable, "-c", COUNT_A_LONG_DRAFT, str(starter_model_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert int(done.stdout.split()[-1]) > 8192, done.stderr[-2000:]
    assert "Token indices sequence length" not in done.stderr
