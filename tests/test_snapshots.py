"""Models whose cache cannot be chunked (sliding-window layers) save whole snapshots."""

from __future__ import annotations

import json

import pytest
from conftest import SLIDING_WINDOW
from mlx_lm.models.cache import RotatingKVCache

from app.engine.chat import ChatSession
from app.engine.conversation import CacheSaved, ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvquant import MixedKVCache
from sessions.cachefiles import CacheIndex, path_from_url, read_file, write_file
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
    if bits:  # the sliding window is quantized too
        assert isinstance(window, MixedKVCache) and window.max_size == SLIDING_WINDOW
        assert isinstance(full, MixedKVCache) and full.scheme.key_bits == bits
    else:
        assert isinstance(window, RotatingKVCache)
    entry = CacheIndex(open_db()).conversation(conversation.id)
    assert entry.kv_format == "snapshot" and len(entry.chunk_keys) == 1
    assert CacheIndex(open_db()).usage()[0] == 1  # the previous snapshot was released

    reopened = ConversationEngine(open_db(), sliding_model)
    finished = turn(reopened, conversation.id, "third", options)
    assert finished.restore.source == "disk"
    assert finished.stats.reused_tokens == len(entry.tokens)
    assert finished.text == fresh(sliding_model, reopened, conversation.id, options, entry.tokens)


def test_a_changed_history_or_a_bad_snapshot_recomputes(sliding_model):
    options = TurnOptions(sampling=SamplingSettings.greedy(8))
    engine = ConversationEngine(open_db(), sliding_model)
    conversation = engine.store.create(sliding_model.name)
    turn(engine, conversation.id, "a first message longer than the sliding window", options)

    index = CacheIndex(open_db())
    path = path_from_url(index.chunk(index.conversation(conversation.id).chunk_keys[0])["url"])
    tensors, metadata = read_file(path, {})
    layout = json.loads(metadata["layout"])
    layout[0]["class"] = "ForeignCache"
    metadata["layout"] = json.dumps(layout)
    write_file(path, tensors, {k: v for k, v in metadata.items() if k != "checksum"})
    finished = turn(ConversationEngine(open_db(), sliding_model), conversation.id, "next", options)
    assert finished.restore.source == "recompute"
    assert "unknown cache class" in finished.restore.rejected

    first = engine.store.get(conversation.id).messages[0]
    events = list(ConversationEngine(open_db(), sliding_model).edit(first.id, "edited", options))
    finished = next(e for e in events if isinstance(e, ReplyFinished))
    assert finished.restore.source == "recompute"
    assert "changed since its snapshot" in finished.restore.rejected
