"""Saved caches past the disk budget: which go first (the chat used longest ago; a chat's
last turn from its end), and that eviction costs only speed (the tiny model)."""

from __future__ import annotations

import pytest
from test_cache_files import OPTIONS, chunk_rows, new_engine, turn

from app.engine.export import export_cache
from sessions.cachefiles import CacheIndex
from sessions.db import open_db


def _prefetch(engine, conversation_id, tmp_path):
    engine.prefetch(conversation_id, OPTIONS.kv)


def _reply_fails(engine, conversation_id, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("the model failed")
        yield

    engine.session.generate = broken
    with pytest.raises(RuntimeError):
        turn(engine, conversation_id, "one more question")


def _save_fails(engine, conversation_id, tmp_path):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    engine.kvstore.save = full
    _, saved = turn(engine, conversation_id, "one more question")
    assert saved.error


def _export(engine, conversation_id, tmp_path):
    export_cache(engine.kvstore, conversation_id, tmp_path / "chat", "tiny")


@pytest.mark.parametrize("use", [_prefetch, _reply_fails, _save_fails, _export])
def test_a_chat_used_since_outlives_one_saved_later_at_eviction(tiny_model, tmp_path, use):
    """Opening a chat (the prefetch a selection starts), a turn on it that failed or
    could not save, an export: each counts as using its files. A turn's restore leaves
    the stamp until after the reply (review, 7 December: these paths had lost it)."""
    engine = new_engine(tiny_model)
    used = engine.store.create(tiny_model.name)
    turn(engine, used.id, "a chat saved first, then used again")
    left = engine.store.create(tiny_model.name)
    turn(engine, left.id, "a chat saved after it and not opened since")
    use(new_engine(tiny_model), used.id, tmp_path)
    index = CacheIndex(open_db())
    index.evict_to_budget(index.usage()[1] - 1)  # room for all but one file
    assert None not in chunk_rows(used.id)
    assert None in chunk_rows(left.id)


def test_eviction_keeps_the_budget_and_only_costs_speed(tiny_model):
    engine = new_engine(tiny_model)
    old = engine.store.create(tiny_model.name)
    turn(engine, old.id, "an old conversation nobody opened for a while")
    one_conversation = CacheIndex(open_db()).usage()[1]
    budget = int(one_conversation * 1.5)
    engine = new_engine(tiny_model, budget_bytes=budget)
    recent = engine.store.create(tiny_model.name)
    turn(engine, recent.id, "a recent conversation with different words in it")
    assert CacheIndex(open_db()).usage()[1] <= budget

    saved = CacheIndex(open_db()).conversation(old.id).tokens
    reopened = new_engine(tiny_model)
    finished, _ = turn(reopened, old.id, "hello again")
    # What the eviction left of the old chat is its start: restored, and the rest recomputed.
    assert finished.restore.source == "disk"
    assert 0 < finished.stats.reused_tokens < len(saved)
    assert [m.role for m in reopened.store.get(old.id).messages] == ["user", "assistant"] * 2


def test_another_chats_save_evicts_a_chats_last_turn_from_its_end(tiny_model):
    """A save stamps a chat's chunks together, the ones it just wrote too: when another
    chat's save needs one chunk's room, the chat loses its last chunk, not the first
    chunk its last turn wrote and, with it, every chunk after."""
    engine = new_engine(tiny_model)
    chat = engine.store.create(tiny_model.name).id
    turn(engine, chat, "hello there")
    turn(engine, chat, "tell me a much longer story about many many things please now")
    rows = chunk_rows(chat)
    assert len(rows) >= 6
    _, used = CacheIndex(open_db()).usage()
    other = new_engine(tiny_model, budget_bytes=used)  # room for all but the newest files
    turn(other, other.store.create(tiny_model.name).id, "hi")

    index = CacheIndex(open_db())
    left = [index.chunk(row["key"]) is not None for row in rows]
    assert left[0] and not left[-1] and left == sorted(left, reverse=True)  # a prefix
    finished, _ = turn(new_engine(tiny_model), chat, "and then?")
    assert finished.restore.source == "disk"
    assert finished.stats.reused_tokens == rows[left.count(True) - 1]["token_end"]
