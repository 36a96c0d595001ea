"""The KV cache on disk under each KV preference, on the tiny model: quantized caches
saved and restored, a changed preference (converted, or read again), and export."""

from __future__ import annotations

import json
import subprocess

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache
from test_cache_files import (  # noqa: F401 (a fixture)
    CHUNK,
    OPTIONS,
    fresh_reply,
    new_engine,
    saved_conversation,
    turn,
)
from test_cli import REPRISE

from app.engine.conversation import TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvscheme import scheme_for
from app.service.preferences import KV_CHOICES
from sessions.cachefiles import CacheIndex
from sessions.db import open_db


def test_quantized_caches_save_and_restore(tiny_model):
    quantized = TurnOptions(
        sampling=SamplingSettings.greedy(10),
        kv=KVSettings(bits=8, group_size=32, quantized_kv_start=0),
    )
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, "hello in eight bits", quantized)
    assert CacheIndex(open_db()).conversation(conversation.id).kv_format == "k8v8g32s4"

    reopened = new_engine(tiny_model)
    saved_tokens = reopened.index.conversation(conversation.id).tokens
    finished, _ = turn(reopened, conversation.id, "still eight bits", quantized)
    assert finished.restore.source == "disk"
    assert finished.stats.kv_format == "8-bit (group 32, 16-bit first 4 + last 64 tokens)"
    assert finished.stats.reused_tokens == len(saved_tokens)
    assert finished.text == fresh_reply(
        tiny_model, reopened, conversation.id, quantized, known=saved_tokens
    )

    # Full precision cannot be rebuilt from 8 bits: recompute, and say why.
    finished, _ = turn(new_engine(tiny_model), conversation.id, "now full precision")
    assert finished.restore.source == "recompute"
    assert "cannot use" in finished.restore.rejected


@pytest.mark.parametrize("bits", [4, 8])
def test_every_quantized_scheme_comes_back_as_it_was_saved(tiny_model, bits, reading):
    """The app's 4-bit (rotated keys) and 8-bit: chunks hold every token quantized,
    the float16 sink as well."""
    options = TurnOptions(
        sampling=SamplingSettings.greedy(10), kv=KVSettings(bits=bits, group_size=32)
    )
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    text = "a message long enough to fill several chunks of sixteen tokens, and then some more"
    turn(engine, conversation.id, text, options)
    live = engine.session.cache
    entry = CacheIndex(open_db()).conversation(conversation.id)
    assert entry.kv_format == scheme_for(bits, 32).format
    stored = live[0].stored()
    assert len(entry.tokens) == stored and stored > 3 * CHUNK

    # What came back is what was saved, bit for bit (the float16 recent window comes
    # back in its quantized form: it is not saved twice).
    restored = new_engine(tiny_model).kvstore.restore(entry, len(entry.tokens)).cache
    for saved_layer, restored_layer in zip(live, restored, strict=True):
        assert restored_layer.scheme.format == saved_layer.scheme.format
        want = saved_layer.quantized_tokens(0, stored)
        assert restored_layer.stored() == stored
        got = restored_layer.quantized_tokens(0, stored)
        assert want.keys() == got.keys() and {"sk", "sv", "k.2", "v.2"} <= set(got)
        assert all(mx.array_equal(want[name], got[name]) for name in want)

    reopened = new_engine(tiny_model)
    finished, _ = turn(reopened, conversation.id, "and again", options)
    assert finished.restore.source == "disk"
    assert finished.stats.reused_tokens == stored


def test_a_changed_kv_preference_converts_or_recomputes(tiny_model, saved_conversation):  # noqa: F811
    """16-bit -> 4-bit is lossless with respect to a fresh run: convert. 4-bit -> 8-bit
    is not: recompute, and say why."""
    four = TurnOptions(sampling=OPTIONS.sampling, kv=KVSettings(bits=4, group_size=32))
    finished, _ = turn(new_engine(tiny_model), saved_conversation, "now in 4 bits", four)
    assert finished.restore.source == "disk"
    assert finished.stats.kv_format.startswith("4-bit (group 32")
    assert CacheIndex(open_db()).conversation(saved_conversation).kv_format == "k4v4g32s4h"

    eight = TurnOptions(sampling=OPTIONS.sampling, kv=KVSettings(bits=8, group_size=32))
    finished, _ = turn(new_engine(tiny_model), saved_conversation, "now in 8 bits", eight)
    assert finished.restore.source == "recompute"
    assert "saved as k4v4g32s4h" in finished.restore.rejected
    assert finished.stats.kv_format.startswith("8-bit (group 32")


def test_an_open_chat_whose_kv_setting_changed_says_it_reads_again(tiny_model):
    """Found on a new-user walk: after switching the Memory preference from 8-bit back
    to full precision, the next message in the open chat said "Continuing: N tokens
    already in memory" while it read the whole conversation again."""
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    eight = TurnOptions(sampling=OPTIONS.sampling, kv=KVSettings(bits=8, group_size=32))
    turn(engine, conversation.id, "hello there", eight)
    finished, _ = turn(engine, conversation.id, "tell me more", eight)
    assert finished.restore.source == "memory"
    finished, _ = turn(engine, conversation.id, "and in full precision", OPTIONS)
    assert finished.restore.source == "recompute"
    assert "cannot use" in finished.restore.rejected
    assert finished.stats.reused_tokens == 0
    assert finished.stats.kv_format in ("float32", "float16", "bfloat16", "16-bit")


@pytest.mark.parametrize("bits", KV_CHOICES)
def test_export_writes_what_mlx_lm_loads_for_every_kv_preference(tiny_model, bits, tmp_path):
    """`reprise cache export`: mlx-lm's own loader reads the file, its classes are
    mlx-lm's, and the next token's logits are those of the app's restored cache."""
    import shutil

    from mlx_lm.models.cache import KVCache

    from sessions import paths

    shutil.copytree(tiny_model.path, paths.models_dir() / tiny_model.name)  # found by name
    options = TurnOptions(
        sampling=SamplingSettings.greedy(10), kv=KVSettings(bits=bits, group_size=32)
    )
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, "a message long enough for a few chunks of tokens", options)
    entry = CacheIndex(open_db()).conversation(conversation.id)

    done = subprocess.run(
        [REPRISE, "cache", "export", str(conversation.id), str(tmp_path / "chat")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "chat.safetensors"  # the name said, with mlx's own suffix
    assert str(out) in done.stdout
    cache, metadata = load_prompt_cache(str(out), return_metadata=True)
    assert all(type(layer) is KVCache for layer in cache)
    assert metadata["model"] == tiny_model.name
    assert json.loads(metadata["tokens"]) == entry.tokens
    assert cache[0].offset == len(entry.tokens)

    restored = new_engine(tiny_model).kvstore.restore(entry, len(entry.tokens)).cache
    if bits is not None:  # as a turn does: the newest tokens are read in 16 bits
        for layer in restored:
            layer.set_window(scheme_for(bits, 32).window)
    token = mx.array([[entry.tokens[-1]]])
    theirs = tiny_model.model(token, cache=cache)[0, -1]
    ours = tiny_model.model(token, cache=restored)[0, -1]
    # Exported in 16 bits: what our cache holds in float32 rounds once more.
    assert mx.allclose(theirs, ours, atol=2e-2).item(), mx.abs(theirs - ours).max()
    assert mx.argmax(theirs).item() == mx.argmax(ours).item()


def test_export_refuses_clearly(tiny_model, saved_conversation, tmp_path):  # noqa: F811
    import shutil

    from sessions import paths

    shutil.copytree(tiny_model.path, paths.models_dir() / tiny_model.name)
    for target, message in (
        (tmp_path, "is a folder"),
        ("/proc/no/such/place.safetensors", "could not write"),
    ):
        done = subprocess.run(
            [REPRISE, "cache", "export", str(saved_conversation), str(target)],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 1 and message in done.stderr, done.stderr
        assert "Traceback" not in done.stderr
    done = subprocess.run(
        [REPRISE, "cache", "export", "999", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1 and "No conversation 999" in done.stderr, done.stderr
