"""Llama 4's chunked attention layers under the KV preference (issue 9).

The family matrix (tests/test_families.py) runs a chunk of 16 tokens, shorter
than the app's 16-bit window, so its chunked layers never hold a quantized
token. Here the chunk is 192 tokens: long enough that the oldest tokens of a
chunk are quantized, short enough that a conversation drops the front.
"""

from __future__ import annotations

import json
from dataclasses import replace

import families
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ChunkedKVCache, make_prompt_cache
from test_families import assert_identical, turn
from test_kv_quant import feed, kl

from app.engine import snapshots
from app.engine.cache_keys import describe_cache
from app.engine.conversation import ConversationEngine, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvconvert import quantizer
from app.engine.kvquant import MixedKVCache
from app.engine.kvscheme import SIXTEEN_BIT, KVScheme, scheme_for
from sessions.cachefiles import CacheRejected
from sessions.db import open_db

CHUNK = 192
TOKENS = np.random.default_rng(0).integers(3, 200, size=400).tolist()
# Past the chunk in one prompt, so the first turn already drops the front.
LONG_FIRST = " ".join(["Tell me about the weather in spring and in autumn"] * 24)
MESSAGES = [LONG_FIRST, "And in winter?", "Which one is better?"]


@pytest.fixture(scope="module")
def chunked_model(starter_model_dir, tmp_path_factory):
    """The matrix's Llama 4 family (replies are words) with chunks of CHUNK tokens."""
    from app.engine.loading import load

    family = families.FAMILIES["chunked"]
    text_config = family.config["text_config"] | {"attention_chunk_size": CHUNK}
    long_chunks = replace(family, name="chunked-192", config={"text_config": text_config})
    return load(families.build(long_chunks, starter_model_dir, tmp_path_factory.mktemp("c")))


@pytest.fixture(scope="module")
def random_chunked():
    """The same architecture with a small vocabulary and untouched random weights
    (every output row live, so predictions feel every attention error)."""
    from mlx_lm.utils import _get_classes

    text_config = families.FAMILIES["chunked"].config["text_config"]
    config = {
        "model_type": "llama4",
        "text_config": text_config | {"attention_chunk_size": CHUNK, "vocab_size": 256},
    }
    model_class, args_class = _get_classes(config)
    mx.random.seed(0)
    return model_class(args_class.from_dict(config))


def chunked_layers(cache: list) -> list:
    return [layer for layer in cache if hasattr(layer, "chunk_size")]


def quantized_cache(model, scheme: KVScheme) -> list:
    cache = make_prompt_cache(model)
    quantizer(scheme)(cache)
    return cache


def test_a_chunked_layer_is_quantized_and_attends_like_its_chunked_cache(random_chunked):
    """Prefill steps then single tokens, past the chunk: the quantized layers drop
    their front where mlx-lm's do, hold the same tokens, and predict alike."""
    model = random_chunked
    reference_cache = make_prompt_cache(model)
    reference = feed(model, reference_cache, TOKENS, steps=(40, 1))
    plain = chunked_layers(reference_cache)
    assert len(plain) == 3 and plain[0].start_position > 0  # the front was dropped

    for scheme, limit in (
        (SIXTEEN_BIT, 1e-6),  # float16 rounding only
        (KVScheme(8, 8, group_size=32, window=16), 1e-4),
        (scheme_for(4, 32), 1e-4),
    ):
        cache = quantized_cache(model, scheme)
        got = feed(model, cache, TOKENS, steps=(40, 1))
        assert kl(reference, got) < limit, scheme
        for ours, theirs in zip(chunked_layers(cache), plain, strict=True):
            assert isinstance(ours, MixedKVCache) and ours.packed_reads
            assert (ours.offset, ours.start_position) == (theirs.offset, theirs.start_position)
            assert ours.stored() == theirs.offset - theirs.start_position
            if scheme.key_bits is not None:  # the tokens older than the window
                assert ours.quantized() >= ours.stored() - scheme.window - 32 > 0


def test_a_chunked_conversion_keeps_the_held_tokens_and_the_start_position(random_chunked):
    """The preference applies to a conversation already under way."""
    model = random_chunked
    cache = make_prompt_cache(model)
    feed(model, cache, TOKENS[:300], steps=(50, 1))
    before = chunked_layers(cache)[0]
    assert isinstance(before, ChunkedKVCache) and before.start_position > 0
    keys, _ = before.keys_and_values()
    quantizer(KVScheme(8, 8, group_size=32))(cache)
    after = chunked_layers(cache)[0]
    assert (after.offset, after.start_position) == (before.offset, before.start_position)
    stored = after.quantized_tokens(0, after.stored())
    want = mx.quantize(keys.astype(mx.float16), group_size=32, bits=8)
    assert all(mx.array_equal(stored[f"k.{n}"], want[n]) for n in range(3))
    assert isinstance(cache[3], MixedKVCache) and not hasattr(cache[3], "chunk_size")


def options(bits: int) -> TurnOptions:
    return TurnOptions(sampling=SamplingSettings.greedy(8), kv=KVSettings(bits, 32))


DESCRIBED = {
    8: "8-bit (group 32, 16-bit last 64 tokens) chunked 192 x3",
    4: "4-bit (group 32, 16-bit last 128 tokens, rotated keys) chunked 192 x3",
}


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_chunked_conversation_reopens_to_the_same_reply(chunked_model, bits):
    never_closed = ConversationEngine(open_db(), chunked_model)
    kept = never_closed.store.create(chunked_model.name)
    replies = [turn(never_closed, kept.id, text, options(bits)) for text in MESSAGES]

    closed = ConversationEngine(open_db(), chunked_model)
    conversation = closed.store.create(chunked_model.name)
    for text in MESSAGES[:2]:
        second = turn(closed, conversation.id, text, options(bits))
    live = closed.session.cache
    for layer in chunked_layers(live):  # some tokens quantized, the front dropped
        assert layer.quantized() > 0 and layer.start_position > 0
    assert DESCRIBED[bits] in second.stats.kv_format
    assert DESCRIBED[bits] in describe_cache(live)
    entry = closed.index.conversation(conversation.id)
    assert_identical(closed.kvstore.restore(entry, len(entry.tokens)).cache, live)

    engine = ConversationEngine(open_db(), chunked_model)  # as after a restart
    reopened = turn(engine, conversation.id, MESSAGES[2], options(bits))
    assert (reopened.restore.source, reopened.restore.rejected) == ("disk", None)
    assert reopened.stats.reused_tokens == len(entry.tokens)
    assert reopened.text == replies[2].text


def test_a_chunked_snapshot_whose_start_and_offset_disagree_is_refused(random_chunked):
    """The snapshot is untrusted bytes: a quantized chunked layer whose start position
    does not end its tokens at its offset is rejected, not used."""
    model = random_chunked
    cache = quantized_cache(model, KVScheme(8, 8, group_size=32, window=16))
    feed(model, cache, TOKENS[:250], steps=(50, 1))
    tensors, layout = snapshots.snapshot(cache)
    arrays = {name: mx.array(array) for name, array in tensors.items()}
    assert_identical(snapshots.restore(make_prompt_cache(model), arrays, layout), cache)

    damaged = json.loads(layout)
    damaged[0]["items"][-1] = ["value", cache[0].start_position + 1]
    with pytest.raises(CacheRejected, match="ChunkedMixedKVCache"):
        snapshots.restore(make_prompt_cache(model), arrays, json.dumps(damaged))
