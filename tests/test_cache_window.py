"""A quantized cache's 16-bit copy of its recent rows, on disk. The last chunk of a
save holds it (a reopen needs it to be the live cache); a save that continues the
conversation writes that chunk again without it, so a chat keeps one copy on disk,
not one per turn."""

from __future__ import annotations

from dataclasses import replace

import pytest
from safetensors import safe_open
from test_cache_files import new_engine, turn
from test_families import assert_identical

from app.engine.codecs import is_window_copy
from app.engine.conversation import TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvquant import MixedKVCache
from app.engine.kvwindow import quantized_at
from sessions.cachefiles import CacheIndex, path_from_url
from sessions.db import open_db

FOUR_BIT = TurnOptions(sampling=SamplingSettings.greedy(8), kv=KVSettings(bits=4, group_size=32))


def window_copies(conversation_id: int) -> list[bool]:
    """Per chunk of the conversation's cache, whether its file holds 16-bit recent rows."""
    index = CacheIndex(open_db())
    found = []
    for key in index.conversation(conversation_id).chunk_keys:
        with safe_open(path_from_url(index.chunk(key)["url"], index.root), "numpy") as f:
            found.append(any(is_window_copy(name) for name in f.keys()))  # noqa: SIM118
    return found


def chunk_arrays(key: str) -> dict:
    index = CacheIndex(open_db())
    with safe_open(path_from_url(index.chunk(key)["url"], index.root), "numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_a_quantized_chat_keeps_one_window_copy_and_reopens_as_it_never_closed(tiny_model):
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    before = {}
    for text in ("hello there", "tell me more about it", "and then what happened next"):
        turn(engine, conversation.id, text, FOUR_BIT)
        copies = window_copies(conversation.id)
        assert copies[-1] and not any(copies[:-1]), copies
        # A chunk written again keeps every byte of its tokens; only the copy went.
        for key, arrays in before.items():
            again = chunk_arrays(key)
            kept = {name for name in arrays if not is_window_copy(name)}
            assert set(again) == kept
            assert all((again[name] == arrays[name]).all() for name in kept)
        before = {
            key: chunk_arrays(key)
            for key in CacheIndex(open_db()).conversation(conversation.id).chunk_keys[-1:]
        }
    bytes_on_disk = CacheIndex(open_db()).usage()[1]

    reopened = new_engine(tiny_model)  # as after a restart
    from_disk, _ = turn(reopened, conversation.id, "one more", FOUR_BIT)
    assert from_disk.restore.source == "disk"
    assert from_disk.stats.reused_tokens == len(engine.session.tokens)
    # The engine that never closed answers the same message from the cache it holds.
    user = reopened.store.message(from_disk.message_id).parent_id
    held = [e for e in engine.edit(user, "one more", FOUR_BIT) if hasattr(e, "restore")][-1]
    assert held.restore.source == "memory"
    assert held.text == from_disk.text
    assert CacheIndex(open_db()).usage()[1] > bytes_on_disk  # it saved, as before


@pytest.mark.parametrize("bits", [8, 4])
def test_a_reopened_quantized_chat_goes_on_quantizing_as_if_it_never_closed(tiny_model, bits):
    """A reply after a reopen long enough that rows leave the 16-bit window for the
    quantized bulk: the restored layers take them as the live ones do."""
    options = TurnOptions(
        sampling=SamplingSettings.greedy(48), kv=KVSettings(bits=bits, group_size=32)
    )
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, "hello there, tell me a story", options)
    saved = len(engine.session.tokens)

    reopened = new_engine(tiny_model)
    from_disk, _ = turn(reopened, conversation.id, "and then?", options)
    assert from_disk.restore.source == "disk"
    scheme = reopened.session.cache[0].scheme
    after = len(reopened.session.tokens)
    assert quantized_at(after, scheme.window, scheme) > quantized_at(saved, scheme.window, scheme)

    user = reopened.store.message(from_disk.message_id).parent_id
    held = [e for e in engine.edit(user, "and then?", options) if hasattr(e, "restore")][-1]
    assert held.restore.source == "memory"
    assert held.text == from_disk.text


@pytest.mark.parametrize("bits", [8, 4])
def test_a_turn_that_cuts_back_into_quantized_rows_still_reopens_as_it_never_closed(
    tiny_model, bits, monkeypatch
):
    """The second turn trims the first reply (re-rendered, its tokens differ), back past
    rows already quantized: they return to the 16-bit window as dequantized values.
    Quantized again they once got codes of their own, where the saved chunks keep the
    first ones, and a reopened chat answered otherwise (an adversarial review)."""
    reply = 40 if bits == 8 else 180  # past the window (64 or 128) and one block more
    options = TurnOptions(
        sampling=SamplingSettings.greedy(reply), kv=KVSettings(bits=bits, group_size=32)
    )
    unflushed = []
    unflush = MixedKVCache._unflush

    def spy(self, until):
        unflushed.append(until < self.quantized())
        unflush(self, until)

    monkeypatch.setattr(MixedKVCache, "_unflush", spy)
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, "Tell me a story about a lighthouse keeper and his cat.", options)
    turn(engine, conversation.id, "And what happened next, in detail?", options)
    assert any(unflushed)  # the case this is about happened

    reopened = new_engine(tiny_model)
    assert reopened.prefetch(conversation.id, options.kv).source == "disk"
    assert_identical(reopened.session.cache, engine.session.cache)


@pytest.mark.parametrize("bits", [8, 4])
def test_rows_cut_back_and_still_in_the_window_reopen_with_their_first_codes(tiny_model, bits):
    """A reply asked again, shorter: rows the cut moved back to the 16-bit window are
    still there when the chat is saved. Their 16-bit values are dequantized ones, which
    quantized again do not always give the codes they had; the reopened layers must
    take the codes the file holds, as the live ones keep them."""
    long_reply = 40 if bits == 8 else 180
    first = TurnOptions(
        sampling=SamplingSettings.greedy(long_reply), kv=KVSettings(bits=bits, group_size=32)
    )
    short = replace(first, sampling=SamplingSettings.greedy(2))
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    asked = "Tell me a story about a lighthouse keeper and his cat."
    done, _ = turn(engine, conversation.id, asked, first)
    user = engine.store.message(done.message_id).parent_id
    list(engine.edit(user, asked, short))
    layer = engine.session.cache[0]
    assert layer._coded > max(layer.quantized(), layer.sink_size)  # the case this is about

    reopened = new_engine(tiny_model)
    assert reopened.prefetch(conversation.id, first.kv).source == "disk"
    assert_identical(reopened.session.cache, engine.session.cache)
    # and a long reply after it quantizes them with those codes, as the live one does
    again, _ = turn(reopened, conversation.id, "Go on.", first)
    user = reopened.store.message(again.message_id).parent_id
    held = [e for e in engine.edit(user, "Go on.", first) if hasattr(e, "restore")][-1]
    assert held.restore.source == "memory"
    assert_identical(reopened.session.cache, engine.session.cache)


def test_a_chat_that_ends_where_another_goes_on_keeps_its_copy(tiny_model):
    """Two chats with the same history share their chunks; when one goes on, the other
    still ends at the shared chunk and reopens with its 16-bit rows."""
    engine = new_engine(tiny_model)
    first, second = (engine.store.create(tiny_model.name) for _ in range(2))
    for conversation in (first, second):
        turn(engine, conversation.id, "hello there", FOUR_BIT)
    index = CacheIndex(open_db())
    assert index.conversation(first.id).chunk_keys == index.conversation(second.id).chunk_keys
    turn(engine, first.id, "tell me more about it", FOUR_BIT)
    assert window_copies(second.id)[-1]
    assert window_copies(first.id)[-1]


def test_a_crash_while_a_chunk_is_written_again_leaves_nothing_stale(tiny_model, monkeypatch):
    """Killed between the new file and its index row: no row names a file of another
    size (`cache verify` finds nothing), the orphan goes with gc, and the chat reopens."""
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, "hello there", FOUR_BIT)
    rewritten = CacheIndex(open_db()).conversation(conversation.id).chunk_keys[-1]
    add_chunk = CacheIndex.add_chunk

    def killed_for_the_rewrite(self, key, *args):
        if key == rewritten:
            raise KeyboardInterrupt  # as a kill would stop it, after the file, before the row
        return add_chunk(self, key, *args)

    monkeypatch.setattr(CacheIndex, "add_chunk", killed_for_the_rewrite)
    with pytest.raises(KeyboardInterrupt):
        turn(engine, conversation.id, "tell me more about it", FOUR_BIT)
    monkeypatch.setattr(CacheIndex, "add_chunk", add_chunk)  # not undo(): it keeps the tmp dirs

    index = CacheIndex(open_db())
    assert index.verify() == []
    assert index.collect_garbage(orphan_age=0)["orphan_files"] >= 1
    reopened, _ = turn(new_engine(tiny_model), conversation.id, "one more", FOUR_BIT)
    assert reopened.text


def test_a_chat_that_ends_where_another_went_on_writes_its_copy_back(tiny_model):
    """The other order: one chat went on past a chunk (written again without its copy),
    then another ends there. Its save writes the copy back, so that it reopens with
    its 16-bit rows, as it never closed."""
    engine = new_engine(tiny_model)
    first = engine.store.create(tiny_model.name)
    turn(engine, first.id, "hello there", FOUR_BIT)
    turn(engine, first.id, "tell me more about it", FOUR_BIT)
    assert not any(window_copies(first.id)[:-1])
    second = engine.store.create(tiny_model.name)
    turn(engine, second.id, "hello there", FOUR_BIT)
    index = CacheIndex(open_db())
    ours = index.conversation(second.id).chunk_keys
    assert index.conversation(first.id).chunk_keys[: len(ours)] == ours
    assert window_copies(second.id)[-1] and window_copies(first.id)[len(ours) - 1]

    entry = index.conversation(second.id)
    restored = new_engine(tiny_model).kvstore.restore(entry, len(entry.tokens))
    assert_identical(restored.cache, engine.session.cache)
