"""Sliding windows whose checkpoints share rows with the ones before (issue 14).

A turn's checkpoint holds the window rows of its own tokens, not the whole window
again (app/engine/window_rows.py); a reopen puts each window together from the
checkpoints back to where it starts, slot for slot as the live layer held it.
"""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from families import FAMILIES, build
from mlx_lm.models.cache import ChunkedKVCache, RotatingKVCache
from test_checkpoint_chunks import FILE_OVERHEAD, OPTIONS, asked_then, turn
from test_families import assert_identical, fresh_reply

from app.engine import checkpoint_chain, snapshots, window_rows
from app.engine.conversation import ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings
from app.engine.kvchunked import ChunkedMixedKVCache
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import APP_SCHEMES, SIXTEEN_BIT
from sessions.cachefiles import CacheIndex, CacheRejected, path_from_url, read_file
from sessions.db import open_db

WINDOW = 64  # several short turns fit in it, so that a window spans checkpoints
MESSAGES = ["hello there", "and then", "what next", "go on", "more", "and so", "again", "end"]


@pytest.fixture(scope="module")
def wide_model(starter_model_dir, tmp_path_factory):
    """The family matrix's gemma3-style model with windows of 64 tokens."""
    from app.engine.loading import load

    family = FAMILIES["sliding"]
    wide = replace(family, name="sliding-64", config={**family.config, "sliding_window": WINDOW})
    return load(build(wide, starter_model_dir, tmp_path_factory.mktemp("wide")))


def chat(loaded, turns: int) -> tuple[ConversationEngine, int, list]:
    engine = ConversationEngine(open_db(), loaded)
    conversation = engine.store.create(loaded.name)
    saves = [turn(engine, conversation.id, text)[1] for text in MESSAGES[:turns]]
    return engine, conversation.id, saves


def kv_bytes_per_token(cache: list) -> int:
    """What one token takes in every layer, global and windows (the CPU path's float16)."""
    layers = [layer for layer in cache if type(layer) is MixedKVCache]
    assert len(layers) == len(cache)
    buffers = [(layer.bulk[0].buffers[0], layer.bulk[1].buffers[0]) for layer in layers]
    return sum(2 * k.shape[1] * (k.shape[3] + v.shape[3]) for k, v in buffers)


def windows_of(index: CacheIndex, key: str, rows: str = "rows") -> list[tuple[str, list[int]]]:
    """(class, [first, end, held]) of each window of a checkpoint: positions [first, end)
    are in its file, [end - held, first) in those before it."""
    _, metadata = read_file(path_from_url(index.chunk(key)["url"]), {})
    return [(s["class"], s[rows]) for s in json.loads(metadata["layout"]) if rows in s]


def test_a_turn_writes_its_own_tokens_rows_not_the_whole_window_again(wide_model):
    engine, conversation_id, saves = chat(wide_model, 8)
    index = CacheIndex(open_db())
    entry = index.conversation(conversation_id)
    ends = [index.chunk(key)["token_end"] for key in entry.checkpoint_keys]
    per_token = kv_bytes_per_token(engine.session.cache)
    turns = zip(ends[-4:-1], ends[-3:], strict=True)  # each turn's checkpoint, and the last
    for saved, (before, after) in zip(saves[-3:], turns, strict=True):
        new = after - before
        assert 0 < new < WINDOW / 2  # a short turn: the old way wrote the whole window
        files = saved.report.chunks_written
        assert saved.report.bytes_written <= 1.3 * new * per_token + FILE_OVERHEAD * files
    # The windows of the last checkpoint start in the ones before it.
    windows = windows_of(index, entry.checkpoint_keys[-1])
    assert len(windows) == 2
    assert all(first > end - held for _, (first, end, held) in windows)


def test_a_reopen_puts_the_windows_together_as_they_were(wide_model, reading):
    never_closed, kept, _ = chat(wide_model, 7)
    expected, _ = turn(never_closed, kept, "so what now")

    closed, conversation_id, _ = chat(wide_model, 7)
    entry = closed.index.conversation(conversation_id)
    restored = closed.kvstore.restore(entry, len(entry.tokens))
    assert restored.rejected is None and restored.tokens == entry.tokens
    assert_identical(restored.cache, closed.session.cache)
    last = closed.index.chunk(entry.checkpoint_keys[-1])["bytes"]
    chunks = closed.kvstore.chunk_bytes(entry, len(entry.tokens))
    assert restored.bytes_read > last + chunks  # the checkpoints before it gave rows too

    reopened = ConversationEngine(open_db(), wide_model)
    finished, _ = turn(reopened, conversation_id, "so what now")
    assert (finished.restore.source, finished.restore.rejected) == ("disk", None)
    assert finished.text == expected.text


def test_an_edit_resumes_from_a_checkpoint_whose_windows_go_back_further(wide_model):
    engine, conversation_id, _ = chat(wide_model, 6)
    fourth = engine.store.get(conversation_id).messages[6]  # the fourth user message
    events = list(engine.edit(fourth.id, "an edited fourth message", OPTIONS))
    edited = next(e for e in events if isinstance(e, ReplyFinished))
    assert (edited.restore.source, edited.restore.rejected) == ("disk", None)

    again, other, _ = chat(wide_model, 3)  # the edited chat, computed afresh
    recomputed, _ = turn(again, other, "an edited fourth message")
    assert edited.text == recomputed.text


def test_an_8_bit_chats_windows_share_their_rows_too(wide_model):
    quantized = TurnOptions(sampling=OPTIONS.sampling, kv=KVSettings(bits=8, group_size=32))
    engine = ConversationEngine(open_db(), wide_model)
    conversation_id = engine.store.create(wide_model.name).id
    for text in MESSAGES[:6]:
        list(engine.send(conversation_id, text, quantized))
    entry = engine.index.conversation(conversation_id)
    windows = windows_of(engine.index, entry.checkpoint_keys[-1])
    assert [name for name, _ in windows] == ["MixedKVCache"] * 2
    assert all(first > end - held for _, (first, end, held) in windows)
    # and their recent 16-bit rows (here the whole window: 8-bit keeps 64 in 16 bits)
    recent = windows_of(engine.index, entry.checkpoint_keys[-1], "recent_rows")
    assert len(recent) == 2 and all(first > end - held for _, (first, end, held) in recent)
    restored = engine.kvstore.restore(entry, len(entry.tokens))
    assert restored.rejected is None
    assert_identical(restored.cache, engine.session.cache)


def test_a_chat_keeps_a_window_of_checkpoints_not_its_whole_history(wide_model):
    _, conversation_id, _ = chat(wide_model, 8)
    index = CacheIndex(open_db())
    entry = index.conversation(conversation_id)
    rows = [index.chunk(key) for key in entry.checkpoint_keys]
    assert len(rows) > 4  # the four a turn can go on from, and those they need rows of
    oldest_needed = min(row["token_start"] for row in rows[-4:])
    assert rows[0]["token_end"] > oldest_needed  # none older than the windows need
    assert rows[1]["token_end"] <= oldest_needed + WINDOW


def test_a_lost_checkpoint_before_is_refused_and_the_next_save_stands_alone(wide_model, reading):
    _, conversation_id, _ = chat(wide_model, 6)
    index = CacheIndex(open_db())
    entry = index.conversation(conversation_id)
    path_from_url(index.chunk(entry.checkpoint_keys[-2])["url"]).unlink()

    reopened = ConversationEngine(open_db(), wide_model)
    finished, _ = turn(reopened, conversation_id, "so what now")
    assert finished.restore.source == "recompute" and finished.restore.rejected
    # recomputed in one prefill: the reply a fresh session gives
    assert finished.text == fresh_reply(wide_model, asked_then(reopened, conversation_id), OPTIONS)
    # The save after it holds its windows whole, and the chat reopens from it.
    entry = index.conversation(conversation_id)
    windows = windows_of(index, entry.checkpoint_keys[-1])
    assert windows and all(first == end - held for _, (first, end, held) in windows)
    later = ConversationEngine(open_db(), wide_model)
    again, _ = turn(later, conversation_id, "and after that")
    assert (again.restore.source, again.restore.rejected) == ("disk", None)


def test_a_chat_saved_before_windows_shared_rows_reopens_after_it_goes_on(wide_model, monkeypatch):
    with monkeypatch.context() as before:  # as the version before saved: windows whole
        before.setattr(window_rows, "cut", lambda tensors, layout, since: (tensors, layout, 0))
        before.setattr(checkpoint_chain, "parent", lambda points: None)
        engine, conversation_id, _ = chat(wide_model, 4)
    old = engine.index.chunk(engine.index.conversation(conversation_id).checkpoint_keys[-1])
    assert (old["token_start"], old["rows_from"]) == (0, None)
    turn(engine, conversation_id, "and now")  # this version: the rows since the last
    entry = engine.index.conversation(conversation_id)
    assert all(
        first > end - held
        for _, (first, end, held) in windows_of(engine.index, entry.checkpoint_keys[-1])
    )
    restored = engine.kvstore.restore(entry, len(entry.tokens))
    assert (restored.rejected, restored.tokens) == (None, entry.tokens)
    assert_identical(restored.cache, engine.session.cache)


def test_a_checkpoint_lost_in_the_middle_leaves_the_ones_before_it(wide_model):
    engine, conversation_id, _ = chat(wide_model, 8)
    entry = engine.index.conversation(conversation_id)
    ends = [engine.index.chunk(key)["token_end"] for key in entry.checkpoint_keys]
    engine.index.delete_chunk(entry.checkpoint_keys[-3])  # evicted

    reopened = ConversationEngine(open_db(), wide_model)
    finished, _ = turn(reopened, conversation_id, "so what now")
    # the two after it take rows from it: the one before it is the latest whole chain
    assert (finished.restore.source, finished.restore.rejected) == ("disk", None)
    assert finished.restore.checkpoint == len(ends) - 3
    assert finished.stats.reused_tokens == ends[-4]
    entry = engine.index.conversation(conversation_id)  # the save after it stands alone
    windows = windows_of(engine.index, entry.checkpoint_keys[-1])
    assert windows and all(first == end - held for _, (first, end, held) in windows)
    restored = reopened.kvstore.restore(entry, len(entry.tokens))
    assert (restored.rejected, restored.tokens) == (None, entry.tokens)
    # its windows are the live ones (the global layer's chunks kept from before hold
    # the tokens the turn recomputed as they were first computed, as chunks always do)
    assert_identical(restored.cache[:2], reopened.session.cache[:2])


def test_a_reply_given_again_after_a_lost_checkpoint_is_saved_whole_again(wide_model):
    engine, conversation_id, _ = chat(wide_model, 6)
    entry = engine.index.conversation(conversation_id)
    engine.index.delete_chunk(entry.checkpoint_keys[-2])  # the last one's rows begin there
    reply = engine.store.get(conversation_id).messages[-1]
    events = list(engine.regenerate(conversation_id, OPTIONS))
    assert next(e for e in events if isinstance(e, ReplyFinished)).text == reply.content
    again = engine.index.conversation(conversation_id)
    assert again.checkpoint_keys[-1] == entry.checkpoint_keys[-1]  # the same tokens, and key
    windows = windows_of(engine.index, again.checkpoint_keys[-1])
    assert windows and all(first == end - held for _, (first, end, held) in windows)
    restored = engine.kvstore.restore(again, len(again.tokens))
    assert (restored.rejected, restored.checkpoint) == (None, len(again.checkpoint_keys))


def test_a_window_goes_back_through_no_more_checkpoints_than_a_restore_reads(
    wide_model, monkeypatch
):
    monkeypatch.setattr(window_rows, "MAX_EARLIER", 2)
    engine, conversation_id, _ = chat(wide_model, 8)
    entry = engine.index.conversation(conversation_id)
    rows = [engine.index.chunk(key) for key in entry.checkpoint_keys]
    points = [
        checkpoint_chain.Point.of(k, r) for k, r in zip(entry.checkpoint_keys, rows, strict=True)
    ]
    chains = [checkpoint_chain.chain(point, points) for point in points[-4:]]
    assert all(found is not None and len(found) <= 3 for found in chains)
    assert any(point.whole for point in points[-4:])  # one holds its windows whole again
    restored = engine.kvstore.restore(entry, len(entry.tokens))
    assert restored.rejected is None
    assert_identical(restored.cache, engine.session.cache)


# -- the layers themselves: every way a window fills, rotates and is cut ----------------


def _feed(layer, sizes: list[int], seed: int) -> None:
    """Tokens in steps of `sizes` (more than one: a prefill's concatenation; one: a
    decode step, which rotates a full ring in place)."""
    rng = np.random.default_rng(seed)
    for n in sizes:
        keys, values = (
            mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float16)) for _ in "kv"
        )
        if hasattr(layer, "maybe_trim_front"):  # as Llama 4 calls it before each pass
            layer.maybe_trim_front()
        layer.update_and_fetch(keys, values)


def _as_read(tensors: dict) -> dict:
    return {name: mx.array(array) for name, array in tensors.items()}


def _window(bits: int) -> MixedKVCache:
    """The app's quantized window, its 16-bit tail short enough to move along it."""
    return MixedKVCache(replace(APP_SCHEMES[f"{bits}-bit"], window=4), max_size=12)


STEPS = [5, 1, 1, 9, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1]
WAYS = {
    "ring, prefills and decode steps": (lambda: RotatingKVCache(max_size=12), STEPS),
    "ring, decode steps only": (lambda: RotatingKVCache(max_size=12), [1] * 30),
    "ring, one long prefill": (lambda: RotatingKVCache(max_size=12), [20, 1, 1, 1, 7]),
    "16-bit window": (lambda: MixedKVCache(SIXTEEN_BIT, max_size=12), STEPS),
    "8-bit window": (lambda: _window(8), STEPS),
    "4-bit window, keys rotated": (lambda: _window(4), STEPS),
    "Llama 4's chunk": (lambda: ChunkedKVCache(chunk_size=12), STEPS),
    "16-bit chunk": (lambda: ChunkedMixedKVCache(SIXTEEN_BIT, chunk_size=12), STEPS),
    "8-bit chunk": (
        lambda: ChunkedMixedKVCache(replace(APP_SCHEMES["8-bit"], window=4), 12),
        STEPS,
    ),
}


@pytest.mark.parametrize("way", WAYS.values(), ids=WAYS.keys())
def test_a_window_cut_at_every_point_comes_back_slot_for_slot(way):
    make, sizes = way
    live = make()
    saved: dict[int, tuple[dict, str]] = {}
    since = 0
    for step in range(len(sizes)):
        _feed(live, sizes[step : step + 1], seed=step)
        tensors, layout = snapshots.snapshot([live])
        tensors, layout, needs_from = window_rows.cut(tensors, layout, since)
        first, end, held = json.loads(layout)[0]["rows"]  # only the rows since the last
        assert (first, end, needs_from) == (max(end - held, since), live.offset, end - held)
        saved[live.offset] = (_as_read(tensors), layout)
        filled = window_rows.fill(*saved[live.offset], lambda end: saved[end])
        restored, _ = snapshots.restore_checkpoint([make()], *filled)
        assert_same_window(restored[0], live)
        since = live.offset


def assert_same_window(restored, live) -> None:
    """The window holds what the live one does, and goes on as it does: a ring holds
    its rows in the same slots (a ring not yet full is restored without its unused
    slots, as mlx-lm's own loading does)."""
    if type(live) is not RotatingKVCache:
        assert_identical([restored], [live])
        return
    assert (restored.offset, restored._idx, restored.max_size) == (live.offset, live._idx, 12)
    for ours, theirs in zip(restored.keys_and_values(), live.keys_and_values(), strict=True):
        assert np.array_equal(np.array(ours), np.array(theirs))
    twin = RotatingKVCache(max_size=12)  # goes on in the live one's stead
    twin.keys, twin.values = mx.array(live.keys), mx.array(live.values)
    twin.offset, twin._idx = live.offset, live._idx
    for layer in (restored, twin):
        _feed(layer, [1], seed=99)
    for ours, theirs in zip(restored.keys_and_values(), twin.keys_and_values(), strict=True):
        assert np.array_equal(np.array(ours), np.array(theirs))


def test_rows_that_do_not_add_up_are_refused():
    live = RotatingKVCache(max_size=12)
    _feed(live, [10], seed=0)
    first = window_rows.cut(*snapshots.snapshot([live]), 0)
    _feed(live, [1, 1, 1], seed=1)
    second = window_rows.cut(*snapshots.snapshot([live]), 10)
    saved = {10: (_as_read(first[0]), first[1])}
    tensors = _as_read(second[0])
    layout = json.loads(second[1])

    def refused(changed: list, earlier=lambda end: saved[end]) -> None:
        with pytest.raises(CacheRejected):
            window_rows.fill(tensors, json.dumps(changed), earlier)

    refused([{**layout[0], "rows": [9, 13, 12]}])  # its arrays hold 3 rows, not 4
    refused([{**layout[0], "rows": [10, 14, 12]}])  # an end that is not its offset
    refused([{**layout[0], "rows": [10, 13, 14]}])  # more rows than its window holds
    refused([{**layout[0], "rows": [10, 13, "12"]}])
    refused(layout, earlier=lambda end: (_ for _ in ()).throw(CacheRejected("gone")))
    other = json.loads(first[1])
    other[0]["rows"] = [5, 10, 10]
    refused(layout, earlier=lambda end: (saved[10][0], json.dumps(other)))  # 10 rows, not 5
    longer = RotatingKVCache(max_size=12)  # a window of 11 positions where 10 were asked for
    _feed(longer, [11], seed=0)
    tensors_11, layout_11, _ = window_rows.cut(*snapshots.snapshot([longer]), 0)
    refused(layout, earlier=lambda end: (_as_read(tensors_11), layout_11))
