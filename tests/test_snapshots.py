"""Models whose cache cannot be chunked (sliding-window layers) save their
full-attention layers in token chunks and the others in one checkpoint per turn."""

from __future__ import annotations

import families
import numpy as np
import pytest
from conftest import SLIDING_WINDOW
from tampering import rewrite_chunk, rewrite_layout

from app.engine import checkpoint_chain
from app.engine.chat import ChatSession
from app.engine.conversation import CacheSaved, ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvquant import MixedKVCache
from sessions.cachefiles import CacheIndex
from sessions.db import open_db


def turn(engine, conversation_id, text, options) -> ReplyFinished:
    events = list(engine.send(conversation_id, text, options))
    assert isinstance(events[-1], CacheSaved) and events[-1].error is None
    return next(e for e in events if isinstance(e, ReplyFinished))


def fresh(loaded, engine, conversation_id, options, known) -> str:
    """No cache, same prompt tokens (the saved ones kept as they were)."""
    messages = engine.store.get(conversation_id).chat_messages()[:-1]
    session = ChatSession(loaded)
    prompt = session.render(messages, known=known)
    *_, finished = session.generate(prompt, sampling=options.sampling, kv=options.kv)
    return finished.text


@pytest.mark.parametrize("bits", [None, 8])
def test_a_sliding_window_conversation_reopens_from_its_snapshot(sliding_model, bits):
    options = TurnOptions(
        sampling=SamplingSettings.greedy(8), kv=KVSettings(bits=bits, group_size=32)
    )
    engine = ConversationEngine(open_db(), sliding_model)
    conversation = engine.store.create(sliding_model.name)
    turn(engine, conversation.id, "a first message longer than the sliding window", options)
    turn(engine, conversation.id, "and a second one", options)
    window, full = engine.session.cache
    # The sliding window is stored as the full layer is: quantized, or for 16 bits in
    # float16 (the CPU path computes in float32).
    assert isinstance(window, MixedKVCache) and window.max_size == SLIDING_WINDOW
    assert isinstance(full, MixedKVCache) and full.scheme.key_bits == bits
    entry = CacheIndex(open_db()).conversation(conversation.id)
    assert entry.kv_format != "snapshot" and len(entry.checkpoint_keys) == 2  # one per turn
    assert len(entry.chunk_keys) == 2  # the full-attention layer: each turn's tokens
    assert CacheIndex(open_db()).usage()[0] == 4

    reopened = ConversationEngine(open_db(), sliding_model)
    finished = turn(reopened, conversation.id, "third", options)
    assert finished.restore.source == "disk" and finished.restore.checkpoint == 2
    assert finished.stats.reused_tokens == len(entry.tokens)
    assert finished.text == fresh(sliding_model, reopened, conversation.id, options, entry.tokens)


@pytest.mark.parametrize(
    "damage",
    [
        lambda layout: layout[0].update({"class": "ForeignCache"}),
        lambda layout: layout[0]["items"].__setitem__(2, ["value", "many"]),  # the offset
        lambda layout: layout[0]["items"].__setitem__(2, ["value", -3]),
        lambda layout: layout[0]["items"].__setitem__(2, ["value", 2.5]),
        lambda layout: layout[0]["items"].__setitem__(4, ["value", 64]),  # the window
        lambda layout: layout[1]["items"].pop(),
        lambda layout: layout[1]["items"].__setitem__(0, ["array", "9.9"]),
    ],
    ids=["class", "text", "negative", "float", "window", "short-state", "no-tensor"],
)
def test_a_tampered_snapshot_layout_is_refused(words_model, damage):
    options = TurnOptions(sampling=SamplingSettings.greedy(2))
    engine = ConversationEngine(open_db(), words_model)
    conversation = engine.store.create(words_model.name)
    turn(engine, conversation.id, "a first message longer than the sliding window", options)
    index = CacheIndex(open_db())
    rewrite_layout(index, index.conversation(conversation.id).checkpoint_keys[0], damage)

    finished = turn(ConversationEngine(open_db(), words_model), conversation.id, "next", options)
    assert finished.restore.source == "recompute" and finished.restore.rejected
    assert len(finished.text.split()) == 2  # the turn went on, recomputed


def _each_window_array(change):
    """A checkpoint change applied to every array of its sliding windows' states."""

    def changed(tensors: dict, _metadata: dict) -> None:
        for name in [n for n in tensors if n.count(".") == 2]:
            tensors[name] = change(tensors[name])

    return changed


TAMPERED_ARRAYS = {
    "more heads": lambda a: np.concatenate([a] * 3, axis=1),
    "narrower rows": lambda a: np.ascontiguousarray(a[..., : a.shape[-1] // 2]),
    "float32": lambda a: a.astype(np.float32),
    "codes for rows": lambda a: a.view(np.uint32),
}


@pytest.mark.parametrize("change", TAMPERED_ARRAYS.values(), ids=TAMPERED_ARRAYS.keys())
def test_a_checkpoint_whose_windows_are_not_the_models_is_refused(words_model, change):
    """Arrays of another shape or type than the model's layer holds (signed anew): the
    turn recomputes, where it used to fail inside the model at the next token."""
    options = TurnOptions(sampling=SamplingSettings.greedy(2))
    engine = ConversationEngine(open_db(), words_model)
    conversation = engine.store.create(words_model.name)
    turn(engine, conversation.id, "a first message longer than the sliding window", options)
    index = CacheIndex(open_db())
    key = index.conversation(conversation.id).checkpoint_keys[0]
    rewrite_chunk(index, key, _each_window_array(change))

    finished = turn(ConversationEngine(open_db(), words_model), conversation.id, "next", options)
    assert finished.restore.source == "recompute" and "MixedKVCache" in finished.restore.rejected
    assert len(finished.text.split()) == 2


def test_a_changed_history_or_a_bad_snapshot_recomputes(sliding_model):
    options = TurnOptions(sampling=SamplingSettings.greedy(8))
    engine = ConversationEngine(open_db(), sliding_model)
    conversation = engine.store.create(sliding_model.name)
    turn(engine, conversation.id, "a first message longer than the sliding window", options)

    index = CacheIndex(open_db())
    rewrite_layout(
        index,
        index.conversation(conversation.id).checkpoint_keys[0],
        lambda layout: layout[0].update({"class": "ForeignCache"}),
    )
    finished = turn(ConversationEngine(open_db(), sliding_model), conversation.id, "next", options)
    assert finished.restore.source == "recompute"
    assert "unknown cache class" in finished.restore.rejected

    first = engine.store.get(conversation.id).messages[0]
    events = list(ConversationEngine(open_db(), sliding_model).edit(first.id, "edited", options))
    finished = next(e for e in events if isinstance(e, ReplyFinished))
    assert finished.restore.source == "recompute"
    assert "changed before its first checkpoint" in finished.restore.rejected


@pytest.fixture(scope="module")
def words_model(starter_model_dir, tmp_path_factory):
    """A gemma3-style sliding-window model whose replies are words, so that an edited
    conversation, tokenized afresh, still starts with the saved tokens."""
    from app.engine.loading import load

    return load(families.build("sliding", starter_model_dir, tmp_path_factory.mktemp("words")))


def test_an_edit_resumes_from_the_checkpoint_before_it_and_drops_the_old_branch(words_model):
    options = TurnOptions(sampling=SamplingSettings.greedy(4))
    engine = ConversationEngine(open_db(), words_model)
    conversation = engine.store.create(words_model.name)
    first = turn(engine, conversation.id, "a first message longer than the sliding window", options)
    for text in ("second", "third"):
        turn(engine, conversation.id, text, options)
    index = CacheIndex(open_db())
    assert len(index.conversation(conversation.id).checkpoint_keys) == 3

    second = engine.store.get(conversation.id).messages[2]
    events = list(engine.edit(second.id, "an edited second", options))
    edited = next(e for e in events if isinstance(e, ReplyFinished))
    assert edited.restore.source == "disk" and edited.restore.checkpoint == 1, edited.restore
    assert edited.stats.reused_tokens == first.stats.prompt_tokens + 4
    # The new branch keeps the first turn's checkpoint and its own, and the chunks of
    # its tokens; the old branch's later checkpoints and chunks are nobody's now, and gone.
    entry = index.conversation(conversation.id)
    assert len(entry.checkpoint_keys) == 2 and len(entry.chunk_keys) == 2
    assert index.usage()[0] == 4


def test_a_conversation_keeps_its_latest_checkpoints(sliding_model, monkeypatch):
    monkeypatch.setattr(checkpoint_chain, "MAX_CHECKPOINTS", 2)
    options = TurnOptions(sampling=SamplingSettings.greedy(2))
    engine = ConversationEngine(open_db(), sliding_model)
    conversation = engine.store.create(sliding_model.name)
    ends = []
    for text in ("one", "two", "three"):
        turn(engine, conversation.id, text, options)
        ends.append(len(engine.session.tokens))
    index = CacheIndex(open_db())
    entry = index.conversation(conversation.id)
    assert [index.chunk(key)["token_end"] for key in entry.checkpoint_keys] == ends[-2:]
    assert index.usage()[0] == 2 + len(entry.chunk_keys)
