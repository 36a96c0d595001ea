"""A quantized cache's 16-bit copies of its recent rows, on disk. A reopen needs them to
be the live cache. Each chunk holds a copy of its own positions in the 16-bit tail when
it is written, so a turn writes its new rows once in each form; a chunk the tail has
left behind is written again without its copy, so a chat keeps about a window of
copies on disk, not one per turn (app/engine/recent_copies.py)."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest
from safetensors import safe_open
from test_cache_files import new_engine, turn
from test_families import assert_identical

from app.engine.codecs import is_window_copy
from app.engine.conversation import ConversationEngine, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import parse_format, scheme_for
from app.engine.kvwindow import (
    copy_name,
    copy_span,
    covering_copies,
    quantized_at,
    tail_start_at,
)
from sessions.cachefiles import CacheIndex, path_from_url
from sessions.db import open_db

FOUR_BIT = TurnOptions(sampling=SamplingSettings.greedy(8), kv=KVSettings(bits=4, group_size=32))
# 8-bit keeps 64 tokens in 16 bits: with the tests' 16-token chunks, a few turns of
# 16-token replies leave chunks behind the tail.
EIGHT_BIT = TurnOptions(sampling=SamplingSettings.greedy(16), kv=KVSettings(bits=8, group_size=32))
MESSAGES = ("hello there", "tell me more about it", "and then what happened next", "go on")


def window_copies(conversation_id: int) -> list[bool]:
    """Per chunk of the conversation's cache, whether its file holds 16-bit recent rows."""
    return [copy is not None for *_, copy in copy_spans(conversation_id)[1]]


def copy_spans(conversation_id: int) -> tuple[int, list[tuple[str, int, int, tuple | None]]]:
    """The conversation's token count, and per chunk (key, first token, end, the
    (first, end) positions its file holds a 16-bit copy of, or None)."""
    index = CacheIndex(open_db())
    entry = index.conversation(conversation_id)
    scheme = parse_format(entry.kv_format)
    chunks = []
    for key in entry.chunk_keys:
        row = index.chunk(key)
        with safe_open(path_from_url(row["url"], index.root), "numpy") as f:
            spans = {copy_span(name.split(".", 1)[-1], scheme) for name in f.keys()}  # noqa: SIM118
        spans = {span[:2] for span in spans if span}
        assert len(spans) <= 1
        chunks.append((key, row["token_start"], row["token_end"], spans.pop() if spans else None))
    return len(entry.tokens), chunks


def tail_of(conversation_id: int) -> tuple[int, int]:
    """The positions [first, end) a reopened layer of the conversation holds in 16 bits."""
    entry = CacheIndex(open_db()).conversation(conversation_id)
    count = len(entry.tokens)
    return tail_start_at(count, parse_format(entry.kv_format)), count


def chunk_arrays(key: str) -> dict:
    index = CacheIndex(open_db())
    with safe_open(path_from_url(index.chunk(key)["url"], index.root), "numpy") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118


def test_a_quantized_chat_keeps_copies_of_its_tail_only_and_reopens_as_it_never_closed(
    tiny_model,
):
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    before: dict = {}
    for text in MESSAGES:
        turn(engine, conversation.id, text, EIGHT_BIT)
        count, chunks = copy_spans(conversation.id)
        tail, _ = tail_of(conversation.id)
        copies = [copy for *_, copy in chunks if copy]
        assert covering_copies(copies, tail, count) is not None  # the copies hold the tail
        assert all(copy is None for _, _, end, copy in chunks if end <= tail), (tail, chunks)
        # The turn wrote its own tokens' rows in 16 bits, once: not the whole tail again.
        new = [(start, end, copy) for key, start, end, copy in chunks if key not in before]
        assert sum(end - copy[0] for _, end, copy in new if copy) == count - max(new[0][0], tail)
        # A chunk kept keeps every byte of its tokens; at most its copy went.
        for key, arrays in before.items():
            again = chunk_arrays(key)
            kept = {name for name in arrays if not is_window_copy(name)}
            assert set(again) - kept <= set(arrays) - kept
            assert all((again[name] == arrays[name]).all() for name in kept)
        before = {key: chunk_arrays(key) for key, *_ in chunks}
    assert tail > 3 * 16  # chunks were left behind, and written again without their copies
    bytes_on_disk = CacheIndex(open_db()).usage()[1]

    reopened = new_engine(tiny_model)  # as after a restart
    assert reopened.prefetch(conversation.id, EIGHT_BIT.kv).source == "disk"
    assert_identical(reopened.session.cache, engine.session.cache)
    from_disk, _ = turn(reopened, conversation.id, "one more", EIGHT_BIT)
    assert from_disk.stats.reused_tokens == len(engine.session.tokens)
    # The engine that never closed answers the same message from the cache it holds.
    user = reopened.store.message(from_disk.message_id).parent_id
    held = [e for e in engine.edit(user, "one more", EIGHT_BIT) if hasattr(e, "restore")][-1]
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


def test_a_chat_that_ends_where_another_goes_on_keeps_its_copies(tiny_model):
    """Two chats with the same history share their chunks; when one goes on, far past
    them, the other still ends there and reopens with its 16-bit rows."""
    engines = new_engine(tiny_model), new_engine(tiny_model)
    first, second = (engines[0].store.create(tiny_model.name) for _ in range(2))
    for engine, conversation in zip(engines, (first, second), strict=True):
        turn(engine, conversation.id, MESSAGES[0], EIGHT_BIT)
    index = CacheIndex(open_db())
    assert index.conversation(first.id).chunk_keys == index.conversation(second.id).chunk_keys
    for text in MESSAGES[1:]:
        turn(engines[0], first.id, text, EIGHT_BIT)
    assert tail_of(first.id)[0] > tail_of(second.id)[1]  # its tail left the shared chunks
    assert window_copies(second.id) == [True] * len(window_copies(second.id))

    for engine, conversation in zip(engines, (first, second), strict=True):
        entry = CacheIndex(open_db()).conversation(conversation.id)
        restored = new_engine(tiny_model).kvstore.restore(entry, len(entry.tokens))
        assert_identical(restored.cache, engine.session.cache)


def test_a_crash_while_a_chunk_is_written_again_leaves_nothing_stale(tiny_model, monkeypatch):
    """Killed between the new file of a chunk written again without its copy and its
    index row: no row names a file of another size (`cache verify` finds nothing), the
    orphan goes with gc, and the chat reopens."""
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, MESSAGES[0], EIGHT_BIT)
    written = set(CacheIndex(open_db()).conversation(conversation.id).chunk_keys)
    add_chunk = CacheIndex.add_chunk

    def killed_for_the_rewrite(self, key, *args):
        if key in written:
            raise KeyboardInterrupt  # as a kill would stop it, after the file, before the row
        return add_chunk(self, key, *args)

    monkeypatch.setattr(CacheIndex, "add_chunk", killed_for_the_rewrite)
    with pytest.raises(KeyboardInterrupt):
        turn(engine, conversation.id, MESSAGES[1], EIGHT_BIT)
    monkeypatch.setattr(CacheIndex, "add_chunk", add_chunk)  # not undo(): it keeps the tmp dirs

    index = CacheIndex(open_db())
    assert index.verify() == []
    assert index.collect_garbage(orphan_age=0)["orphan_files"] >= 1
    reopened, _ = turn(new_engine(tiny_model), conversation.id, "one more", EIGHT_BIT)
    assert reopened.text


def test_a_chat_that_ends_where_another_went_on_writes_its_tail_back(tiny_model):
    """The other order: one chat went on past its first chunks (written again without
    their copies), then another ends there. Its save writes its whole tail's copy into
    its last chunk, so that it reopens with its 16-bit rows, as it never closed, and
    the first chat still reopens as it was."""
    engines = new_engine(tiny_model), new_engine(tiny_model)
    first = engines[0].store.create(tiny_model.name)
    for text in MESSAGES:
        turn(engines[0], first.id, text, EIGHT_BIT)
    second = engines[1].store.create(tiny_model.name)
    turn(engines[1], second.id, MESSAGES[0], EIGHT_BIT)
    index = CacheIndex(open_db())
    ours = index.conversation(second.id).chunk_keys
    assert index.conversation(first.id).chunk_keys[: len(ours)] == ours
    assert copy_spans(second.id)[1][-1][3] == tail_of(second.id)
    assert not any(window_copies(second.id)[:-1])

    for engine, conversation in zip(engines, (first, second), strict=True):
        entry = CacheIndex(open_db()).conversation(conversation.id)
        restored = new_engine(tiny_model).kvstore.restore(entry, len(entry.tokens))
        assert_identical(restored.cache, engine.session.cache)


def test_a_layer_writes_its_whole_tail_into_the_last_chunk_after_a_cut():
    """A chunk holds the 16-bit rows of its own positions in the tail; after a cut that
    moved quantized rows back to the tail (dequantized values, which no chunk's copy
    holds), the save's last chunk holds the whole tail, and the chunks before none."""
    layer = MixedKVCache(scheme_for(8, 32))
    rows = mx.random.normal((1, 2, 200, 32)).astype(mx.float16)
    layer.extend(rows, rows)
    layer.offset = 200
    tail = tail_start_at(200, layer.scheme)
    assert set(copies_in(layer.quantized_tokens(176, 200))) == {copy_name(176, 200, "k")}
    assert set(copies_in(layer.quantized_tokens(100, 176))) == {copy_name(tail, 176, "k")}

    layer.trim(60)  # back past rows already quantized
    assert layer.tail_is_dequantized()
    tail = tail_start_at(140, layer.scheme)
    assert set(copies_in(layer.quantized_tokens(128, 140))) == {copy_name(tail, 140, "k")}
    assert not copies_in(layer.quantized_tokens(112, 128))


def copies_in(tensors: dict) -> list[str]:
    return [name for name in tensors if name.startswith("r") and name.endswith("k")]


def app_engine(loaded) -> ConversationEngine:
    """An engine with the app's own chunks of 256 tokens, as in a new process."""
    return ConversationEngine(open_db(), loaded)


def test_copies_stay_about_a_window_as_a_chat_of_long_replies_grows(tiny_model):
    """With the app's 256-token chunks, a reply longer than the window begins its chunk's
    copy partway in; once the window has passed that chunk, the copy goes all the same:
    what is left on disk is the window's, however long the chat (an adversarial review
    found them piling up, one partial copy a turn)."""
    options = TurnOptions(sampling=SamplingSettings.greedy(150), kv=EIGHT_BIT.kv)
    engine = app_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    for n in range(6):
        turn(engine, conversation.id, f"Tell me part {n} of the story.", options)
        tail, count = tail_of(conversation.id)
        chunks = copy_spans(conversation.id)[1]
        assert all(copy is None for _, _, end, copy in chunks if end <= tail), (tail, chunks)
        assert covering_copies([copy for *_, copy in chunks if copy], tail, count) is not None
    assert count > 3 * 256


def test_an_earlier_message_sent_again_with_the_same_reply_reopens_as_it_never_closed(
    tiny_model,
):
    """The first message sent again, unchanged, after a long second turn: the cut moves
    rows back from the quantized bulk to the 16-bit tail (dequantized values), and the
    greedy reply is the one before, so every chunk is kept and none is new. Another
    chat ends where the first turn did, so the first turn's copies are still on disk,
    as computed: the last chunk is written again with the whole tail as the live one
    holds it (an adversarial review found such a reopen differing from the live one).
    The other chat still reopens (its tail then holds those rows dequantized from the
    same codes: the chunk is one key for both)."""
    short = TurnOptions(sampling=SamplingSettings.greedy(24), kv=EIGHT_BIT.kv)
    engine, other = app_engine(tiny_model), app_engine(tiny_model)
    conversation, elsewhere = (engine.store.create(tiny_model.name) for _ in range(2))
    text = " ".join(f"item{n}" for n in range(60))  # about 200 tokens: one chunk
    done, _ = turn(engine, conversation.id, text, short)
    turn(other, elsewhere.id, text, short)
    first = list(engine.session.tokens)
    assert other.session.tokens == first
    longer = replace(short, sampling=SamplingSettings.greedy(120))
    turn(engine, conversation.id, "Go on, at length.", longer)
    user = engine.store.message(done.message_id).parent_id
    saved = list(engine.edit(user, text, short))[-1]
    assert engine.session.tokens == first and engine.session.cache[0].tail_is_dequantized()
    assert saved.report.chunks_written == 1  # the last chunk, again

    reopened = app_engine(tiny_model)
    assert reopened.prefetch(conversation.id, short.kv).source == "disk"
    assert_identical(reopened.session.cache, engine.session.cache)
    assert app_engine(tiny_model).prefetch(elsewhere.id, short.kv).source == "disk"
