"""Every mlx-lm cache family chats, persists and reopens (issue 9).

Each family is a tiny random-weight model built by tests/families.py from
mlx-lm's own class, whose greedy replies are words; each cell runs it through
the real engine (and, for reopening and export, the real `reprise` CLI in a
subprocess). Cells the engine cannot pass yet are strict xfails with the
reason: they turn into failures the day the engine gains the support, and
then the mark goes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from families import FAMILIES, build, cache_classes, held_in_float16
from mlx_lm.models.cache import ArraysCache, load_prompt_cache, make_prompt_cache

from app.engine.chat import ChatSession
from app.engine.conversation import CacheSaved, ConversationEngine, ReplyFinished, TurnOptions
from app.engine.export import as_mlx_lm, export_cache
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvquant import MixedKVCache
from sessions.db import open_db

REPRISE = str(Path(sys.executable).with_name("reprise"))
MESSAGES = ["Tell me about the weather in spring", "And in autumn?", "Which one is better?"]
NOT_TRIMMABLE = ("sliding", "hybrid-qwen3-next", "hybrid-granite", "chunked", "cachelist")

# (cell, family) -> why it fails today (none do now; a new family's gap goes here).
XFAIL: dict[tuple[str, str], str] = {}


def cells(cell: str) -> list:
    return [
        pytest.param(
            name,
            id=name,
            marks=[pytest.mark.xfail(strict=True, reason=XFAIL[(cell, name)])]
            if (cell, name) in XFAIL
            else [],
        )
        for name in FAMILIES
    ]


@pytest.fixture(scope="module")
def family_models(starter_model_dir, tmp_path_factory):
    """Each family's model folder and loaded model, built on first use."""
    from app.engine.loading import load

    folder = tmp_path_factory.mktemp("families")
    built: dict[str, tuple[Path, object]] = {}

    def get(name: str):
        if name not in built:
            path = build(name, starter_model_dir, folder)
            built[name] = (path, load(path))
        return built[name]

    return get


def options(bits: int | None = None) -> TurnOptions:
    return TurnOptions(sampling=SamplingSettings.greedy(8), kv=KVSettings(bits, 32))


def finished_of(events) -> ReplyFinished:
    events = list(events)
    assert isinstance(events[-1], CacheSaved) and events[-1].error is None, events[-1]
    return next(e for e in events if isinstance(e, ReplyFinished))


def turn(engine: ConversationEngine, conversation_id: int, text: str, opts) -> ReplyFinished:
    return finished_of(engine.send(conversation_id, text, opts))


@pytest.fixture(scope="module")
def in_memory(family_models):
    """The three turns of a conversation that never left memory, per (family, bits),
    run once: what every reopened conversation must go on to say."""
    done: dict[tuple[str, int | None], list[ReplyFinished]] = {}

    def get(family: str, bits: int | None = None) -> list[ReplyFinished]:
        if (family, bits) not in done:
            _, loaded = family_models(family)
            engine = ConversationEngine(open_db(), loaded)
            conversation = engine.store.create(loaded.name)
            done[family, bits] = [
                turn(engine, conversation.id, text, options(bits)) for text in MESSAGES
            ]
            engine.index.forget_conversation(conversation.id)
        return done[family, bits]

    return get


def started(loaded, opts, turns: int = 2) -> tuple[ConversationEngine, int]:
    """An engine that has run the first `turns` turns of a new conversation."""
    engine = ConversationEngine(open_db(), loaded)
    conversation = engine.store.create(str(loaded.path))  # `reprise` finds the model by it
    for text in MESSAGES[:turns]:
        turn(engine, conversation.id, text, opts)
    return engine, conversation.id


def fresh_reply(loaded, messages: list[dict], opts) -> str:
    *_, finished = ChatSession(loaded).reply(messages, sampling=opts.sampling, kv=opts.kv)
    return finished.text


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [REPRISE, *args], capture_output=True, text=True, timeout=120, check=False
    )


def parts(cache: list) -> list:
    return [part for layer in cache for part in getattr(layer, "caches", (layer,))]


def flat_state(cache: list) -> list[np.ndarray]:
    """Every array a cache holds, in order (only the used part of KVCache buffers)."""
    arrays = []

    def walk(item) -> None:
        if isinstance(item, mx.array):
            arrays.append(np.array(item.view(mx.uint16) if item.dtype == mx.bfloat16 else item))
        elif isinstance(item, tuple | list):
            for sub in item:
                walk(sub)

    for part in parts(cache):
        state = part.state
        if type(part).__name__ == "KVCache" and part.keys is not None:
            state = (part.keys[..., : part.offset, :], part.values[..., : part.offset, :])
        elif type(part).__name__ == "ChunkedKVCache" and part.keys is not None:
            state = part.keys_and_values()
        walk(state)
    return arrays


def assert_identical(restored: list, live: list) -> None:
    assert cache_classes(restored) == cache_classes(live)
    ours, theirs = flat_state(restored), flat_state(live)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


# -- the words the models write ---------------------------------------------------------


@pytest.mark.parametrize("family", cells("words"))
def test_greedy_replies_are_words_that_survive_a_round_trip(family, family_models):
    _, loaded = family_models(family)
    session = ChatSession(loaded)
    messages = [{"role": "user", "content": MESSAGES[0]}]
    *_, finished = session.reply(messages, sampling=SamplingSettings.greedy(8))
    reply = session.tokens[finished.stats.prompt_tokens :]
    assert len(reply) == 8 and all(w.isalpha() for w in finished.text.split())
    text = loaded.tokenizer.decode(reply)
    assert loaded.tokenizer.encode(text, add_special_tokens=False) == reply
    # The model's own classes, its attention held in float16 (the CPU path's 16 bits).
    assert cache_classes(session.cache) == held_in_float16(FAMILIES[family].caches)


# -- (a) three turns in one process ---------------------------------------------------


@pytest.mark.parametrize("family", cells("memory"))
def test_three_turns_reuse_the_whole_history_in_memory(family, in_memory, family_models):
    first, second, third = in_memory(family)
    assert first.restore.source == "recompute"
    for before, after in ((first, second), (second, third)):
        assert after.restore.source == "memory"
        assert after.stats.reused_tokens == before.stats.prompt_tokens + 8
    # The KV format names every part of a mixed cache, none of them "empty".
    kinds = {type(p).__name__ for p in parts(make_prompt_cache(family_models(family)[1].model))}
    kv_format = third.stats.kv_format
    assert "empty" not in kv_format
    assert ("state" in kv_format) == ("ArraysCache" in kinds)
    assert ("sliding window 16" in kv_format) == ("RotatingKVCache" in kinds)
    assert ("chunked 16" in kv_format) == ("ChunkedKVCache" in kinds)


# -- (c) edit and regenerate an earlier message ---------------------------------------------


@pytest.mark.parametrize("family", cells("edit"))
def test_edit_and_regenerate_resume_from_the_message_before(family, family_models, in_memory):
    _, loaded = family_models(family)
    engine, conversation_id = started(loaded, options(), turns=3)
    boundary = in_memory(family)[1].stats.reused_tokens  # the end of the first turn

    second_user = engine.store.get(conversation_id).messages[2]
    edited = finished_of(engine.edit(second_user.id, "What about winter?", options()))
    messages = engine.store.get(conversation_id).chat_messages()
    assert messages[-2]["content"] == "What about winter?"
    assert edited.text == fresh_reply(loaded, messages[:-1], options())

    again = finished_of(engine.regenerate(conversation_id, options()))
    assert again.text == edited.text  # greedy
    for finished in (edited, again):
        if family in NOT_TRIMMABLE:  # from disk: the checkpoint at the end of the first turn
            assert (finished.restore.source, finished.restore.checkpoint) == ("disk", 1)
            assert finished.stats.reused_tokens == boundary
        else:  # cut back in memory, to all the edited prompt shares
            assert (finished.restore.source, finished.restore.checkpoint) == ("memory", None)
            assert finished.stats.reused_tokens >= boundary


# -- (b) and (d): each KV preference saves, exports, and reopens in a new process --------


def _reopen_in_a_new_process(path: Path, conversation_id: int) -> dict:
    """`reprise chat --conversation ID` goes on with the conversation: its reply record."""
    done = cli(
        "chat", "--model", str(path), "--conversation", str(conversation_id),
        "--temp", "0", "--repetition-penalty", "1", "--max-tokens", "8", "--json", MESSAGES[2],
    )  # fmt: skip  (greedy as in memory: the app's own default penalty is 1.1)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _check_export(engine: ConversationEngine, conversation_id: int, saved: list, out: Path):
    """`cache export` writes what mlx-lm loads: the saved cache in mlx-lm's classes
    (quantized layers dequantized; state, sliding, chunked and CacheList layers as
    they are), and mlx-lm's model goes on from it."""
    export_cache(engine.kvstore, conversation_id, out, engine.loaded.name)
    cache, metadata = load_prompt_cache(str(out), return_metadata=True)
    assert json.loads(metadata["tokens"]) == engine.session.tokens
    assert_identical(cache, [as_mlx_lm(layer) for layer in saved])
    logits = engine.loaded.model(mx.array([[engine.session.tokens[-1]]]), cache=cache)
    assert mx.all(mx.isfinite(logits)).item()


def _check_preference(family_models, in_memory, family: str, bits: int | None, tmp: Path):
    path, loaded = family_models(family)
    engine, conversation_id = started(loaded, options(bits))
    entry = engine.index.conversation(conversation_id)
    assert bool(entry.checkpoint_keys) != FAMILIES[family].chunkable
    restored = engine.kvstore.restore(entry, len(entry.tokens))
    assert restored.rejected is None and restored.tokens == engine.session.tokens
    _check_export(engine, conversation_id, restored.cache, tmp / "exported.safetensors")

    if bits is None:  # from disk in a new process, through the terminal
        record = _reopen_in_a_new_process(path, conversation_id)
        source, rejected, reused, reply = (
            record[k] for k in ("restore_source", "cache_rejected", "reused_tokens", "reply")
        )
    else:
        reopened = ConversationEngine(open_db(), loaded)
        finished = turn(reopened, conversation_id, MESSAGES[2], options(bits))
        source, rejected = finished.restore.source, finished.restore.rejected
        reused, reply = finished.stats.reused_tokens, finished.text
    assert (source, rejected, reused) == ("disk", None, len(entry.tokens))
    assert reply == in_memory(family, bits)[2].text

    for part in parts(engine.session.cache):
        if isinstance(part, ArraysCache):  # recurrent and conv states stay exact
            assert all(a.dtype == mx.float32 for a in part.cache if a is not None)
        elif bits is None:  # float16, the CPU path's 16 bits
            assert isinstance(part, MixedKVCache) and part.scheme.key_bits is None
        else:  # every attention layer, sliding and chunked ones included
            assert isinstance(part, MixedKVCache) and part.scheme.key_bits == bits
    assert_identical(restored.cache, engine.session.cache)  # bit for bit


@pytest.mark.parametrize("family", cells("kv-off"))
def test_kv_off_saves_exports_and_reopens_in_a_new_process_exactly(
    family, family_models, in_memory, tmp_path
):
    _check_preference(family_models, in_memory, family, None, tmp_path)


@pytest.mark.parametrize("family", cells("kv-8"))
def test_kv_8_bit_quantizes_attention_and_reopens_exactly(
    family, family_models, in_memory, tmp_path
):
    _check_preference(family_models, in_memory, family, 8, tmp_path)


@pytest.mark.parametrize("family", cells("kv-4"))
def test_kv_4_bit_quantizes_attention_and_reopens_exactly(
    family, family_models, in_memory, tmp_path
):
    _check_preference(family_models, in_memory, family, 4, tmp_path)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("family", ["sliding", "hybrid-qwen3-next"])
def test_quantized_attention_beside_windows_or_states_reopens_exactly_past_its_window(
    family, bits, family_models
):
    """Long replies in 16-token chunks: the attention layers' 16-bit window moves past
    chunks, which drop their copies of it, and a reply asked again cuts back into rows
    already quantized; a new engine still rebuilds the live cache, windows or recurrent
    state from the checkpoint, attention from the chunks."""
    _, loaded = family_models(family)
    long = TurnOptions(sampling=SamplingSettings.greedy(96), kv=KVSettings(bits, 32))
    engine = ConversationEngine(open_db(), loaded, chunk_tokens=16)
    conversation = engine.store.create(loaded.name)
    finished_of(engine.send(conversation.id, MESSAGES[0], long))
    second = finished_of(engine.send(conversation.id, MESSAGES[1], long))
    user = engine.store.message(second.message_id).parent_id
    finished_of(engine.edit(user, MESSAGES[2], long))
    held = [part for part in engine.session.cache if isinstance(part, MixedKVCache)]
    assert any(part.max_size is None and part.quantized() > 16 for part in held)

    reopened = ConversationEngine(open_db(), loaded, chunk_tokens=16)
    assert reopened.prefetch(conversation.id, long.kv).source == "disk"
    assert_identical(reopened.session.cache, engine.session.cache)
