"""A sliding-window model (gemma3-style: sliding layers and a global one) keeps its
global layer in token chunks and only the sliding windows in each turn's checkpoint
(issue 14): what a turn writes follows its own tokens, not the conversation's length,
and a reopen, an edit, a lost or damaged file all still end in the right reply."""

from __future__ import annotations

import json

import families
import mlx.core as mx
import numpy as np
import pytest
import sqlite_utils
from mlx_lm.models.cache import RotatingKVCache
from tampering import rewrite_chunk, rewrite_layout
from test_families import assert_identical, fresh_reply

from app.engine import snapshots
from app.engine.cache_keys import SNAPSHOT, snapshot_key, tokens_hash
from app.engine.codecs import ChunkManifest
from app.engine.conversation import CacheSaved, ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvquant import MixedKVCache
from sessions.cachefiles import CacheIndex, path_from_url, read_file
from sessions.db import migrations, open_db

FIRST = "a first message longer than the sliding window of this small model"
LATER = "and what came after that"
OPTIONS = TurnOptions(sampling=SamplingSettings.greedy(8))
FILE_OVERHEAD = 1024  # a chunk file's header: names, shapes, metadata (about 0.5 kB)


@pytest.fixture(scope="module")
def words_model(starter_model_dir, tmp_path_factory):
    """The family matrix's gemma3-style model (two sliding layers of 16 tokens, one
    global), whose replies are words: a reopened prompt starts with the saved tokens."""
    from app.engine.loading import load

    return load(families.build("sliding", starter_model_dir, tmp_path_factory.mktemp("swa")))


def turn(engine, conversation_id: int, text: str) -> tuple[ReplyFinished, CacheSaved]:
    events = list(engine.send(conversation_id, text, OPTIONS))
    saved = events[-1]
    assert isinstance(saved, CacheSaved) and saved.error is None
    return next(e for e in events if isinstance(e, ReplyFinished)), saved


def started(loaded, turns: int) -> tuple[ConversationEngine, int]:
    engine = ConversationEngine(open_db(), loaded)
    conversation = engine.store.create(loaded.name)
    for n in range(turns):
        turn(engine, conversation.id, FIRST if n == 0 else LATER)
    return engine, conversation.id


def global_bytes_per_token(cache: list) -> int:
    """What one token of the full-attention layers takes in the chunks (the CPU path's
    16 bits: float16)."""
    layers = [layer for layer in cache if type(layer) is MixedKVCache and layer.max_size is None]
    assert layers and all(layer.scheme.key_bits is None for layer in layers)
    buffers = [(layer.bulk[0].buffers[0], layer.bulk[1].buffers[0]) for layer in layers]
    return sum(2 * k.shape[1] * (k.shape[3] + v.shape[3]) for k, v in buffers)


def test_a_turn_writes_its_new_tokens_and_a_checkpoint_of_the_windows(words_model):
    engine = ConversationEngine(open_db(), words_model)
    assert engine.session.template.writes_replies_back  # so one checkpoint a turn, at its end
    conversation = engine.store.create(words_model.name)
    index, before, rows = CacheIndex(open_db()), 0, []
    for n in range(8):
        _, saved = turn(engine, conversation.id, FIRST if n == 0 else LATER)
        entry = index.conversation(conversation.id)
        checkpoint = index.chunk(entry.checkpoint_keys[-1])["bytes"]
        chunks = saved.report.bytes_written - checkpoint  # the checkpoint is new each turn
        rows.append((len(entry.tokens) - before, chunks, checkpoint, saved.report.chunks_written))
        before = len(entry.tokens)
    # The last turn writes no more than the second, though the history grew 7 times.
    assert rows[-1][1] + rows[-1][2] <= 1.3 * (rows[1][1] + rows[1][2]), rows
    # The checkpoint holds the windows, whatever the length: the same size each turn.
    checkpoints = [checkpoint for _, _, checkpoint, _ in rows[1:]]
    assert max(checkpoints) - min(checkpoints) < 256, checkpoints
    per_token = global_bytes_per_token(engine.session.cache)
    for new, chunks, _, files in rows[1:]:  # the global layer: the turn's tokens only
        assert new * per_token <= chunks <= 1.3 * new * per_token + FILE_OVERHEAD * (files - 1)


def test_a_reopened_conversation_replies_as_the_never_closed_one(words_model, reading):
    never_closed, kept = started(words_model, 4)
    expected, _ = turn(never_closed, kept, "so what now")

    closed, conversation_id = started(words_model, 4)
    entry = closed.index.conversation(conversation_id)
    reopened = ConversationEngine(open_db(), words_model)
    finished, _ = turn(reopened, conversation_id, "so what now")
    assert (finished.restore.source, finished.restore.rejected) == ("disk", None)
    assert finished.restore.checkpoint == 4
    assert finished.stats.reused_tokens == len(entry.tokens)
    assert finished.text == expected.text


def test_an_edit_resumes_from_an_earlier_checkpoint_with_its_chunks_cut_back(words_model):
    engine, conversation_id = started(words_model, 3)
    entry = engine.index.conversation(conversation_id)
    ends = [engine.index.chunk(key)["token_end"] for key in entry.checkpoint_keys]
    second = engine.store.get(conversation_id).messages[4]  # the third user message
    events = list(engine.edit(second.id, "an edited third message", OPTIONS))
    edited = next(e for e in events if isinstance(e, ReplyFinished))
    assert (edited.restore.source, edited.restore.checkpoint) == ("disk", 2)
    assert edited.stats.reused_tokens == ends[1]

    again, other = started(words_model, 2)  # the edited chat, computed afresh
    recomputed, _ = turn(again, other, "an edited third message")
    assert edited.text == recomputed.text


def _damage_file(index: CacheIndex, key: str) -> None:
    path = path_from_url(index.chunk(key)["url"])
    data = bytearray(path.read_bytes())
    data[-4] ^= 0xFF  # in the tensors: the checksum no longer matches
    path.write_bytes(bytes(data))


DAMAGE = {
    "chunk file gone": lambda index, e: path_from_url(index.chunk(e.chunk_keys[0])["url"]).unlink(),
    "chunk damaged": lambda index, e: _damage_file(index, e.chunk_keys[-1]),
    "checkpoint gone": lambda index, e: path_from_url(
        index.chunk(e.checkpoint_keys[-1])["url"]
    ).unlink(),
    "checkpoint damaged": lambda index, e: _damage_file(index, e.checkpoint_keys[-1]),
    "global layer claimed by the checkpoint": lambda index, e: rewrite_layout(
        index, e.checkpoint_keys[-1], lambda layout: layout[2].pop("in_chunks")
    ),
    "sliding layer left to chunks": lambda index, e: rewrite_layout(
        index, e.checkpoint_keys[-1], lambda layout: layout[0].update(in_chunks=True)
    ),
    "chunks disagree with the checkpoint": lambda index, e: rewrite_layout(
        index, e.checkpoint_keys[-1], lambda layout: layout[2].update({"class": "KVCache"})
    ),  # the chunks hold the CPU path's float16 MixedKVCache
    "a chunk stacks a sliding layer with the global one": lambda index, e: rewrite_chunk(
        index, e.chunk_keys[0], _with_layer_1
    ),
}


def _with_layer_1(tensors: dict, _metadata: dict) -> None:
    """The global layer's run ("2-2.k.0") made "1-2.k.0", as if layer 1 were chunked."""
    for name in list(tensors):
        array = tensors.pop(name)
        tensors[f"1-2.{name.partition('.')[2]}"] = np.concatenate([array, array])


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_a_lost_or_damaged_part_is_refused_and_the_turn_recomputes(words_model, damage, reading):
    never_closed, kept = started(words_model, 2)
    expected, _ = turn(never_closed, kept, "so what now")
    _, conversation_id = started(words_model, 2)
    index = CacheIndex(open_db())
    damage(index, index.conversation(conversation_id))

    finished, _ = turn(ConversationEngine(open_db(), words_model), conversation_id, "so what now")
    assert finished.restore.source == "recompute" and finished.restore.rejected
    assert finished.text == expected.text


def test_an_evicted_chunk_resumes_from_the_checkpoint_before_it(words_model):
    never_closed, kept = started(words_model, 3)
    expected, _ = turn(never_closed, kept, "so what now")
    closed, conversation_id = started(words_model, 3)
    entry = closed.index.conversation(conversation_id)
    closed.index.delete_chunk(entry.chunk_keys[-1])  # the last turn's tokens

    finished, _ = turn(ConversationEngine(open_db(), words_model), conversation_id, "so what now")
    assert (finished.restore.source, finished.restore.checkpoint) == ("disk", 2)
    assert finished.text == expected.text


def test_a_whole_snapshot_saved_before_chunks_still_reopens(words_model, tmp_path):
    """A database from before checkpoints (m005): its whole snapshot is a checkpoint
    that holds every layer, and the conversation reopens from it."""
    engine, conversation_id = started(words_model, 1)
    tokens, cache, store = engine.session.tokens, engine.session.cache, engine.kvstore
    key = snapshot_key(store.fingerprint, tokens)
    tensors, layout = snapshots.snapshot(cache)
    manifest = ChunkManifest(
        store.fingerprint, SNAPSHOT, key, 0, len(tokens), tokens_hash(tokens), len(cache)
    )
    store.write(manifest, tensors, {"layout": layout})

    old = _old_database(tmp_path / "old.db")
    row = {k: v for k, v in store.index.chunk(key).items() if k != "rows_from"}  # m006's
    old["cache_chunks"].insert(row)
    old["conversation_caches"].insert(
        {
            "conversation_id": conversation_id,
            "model_fingerprint": store.fingerprint,
            "kv_format": SNAPSHOT,
            "tokens": b"".join(t.to_bytes(4, "little") for t in tokens),
            "chunk_tokens": 0,
            "chunk_keys": json.dumps([key]),
            "updated": "",
        }
    )
    old.conn.close()
    store.index = CacheIndex(open_db(tmp_path / "old.db"), store.index.root)  # upgraded
    entry = store.index.conversation(conversation_id)
    assert (entry.chunk_keys, entry.checkpoint_keys, entry.kv_format) == ([], [key], SNAPSHOT)
    restored = store.restore(entry, len(tokens))
    assert (restored.rejected, restored.tokens, restored.checkpoint) == (None, tokens, 1)
    assert_identical(restored.cache, cache)


def _old_database(path):
    """A database as Reprise made it before checkpoints (m005)."""
    db = sqlite_utils.Database(path)
    migrations.apply(db, stop_before="m005_checkpoint_keys")
    return db


@pytest.fixture(scope="module")
def all_sliding_model(starter_model_dir, tmp_path_factory):
    """The same model with every layer a sliding window, the global one included (mlx-lm
    has no family without a global layer that a tiny model builds)."""
    from app.engine.loading import load

    folder = families.build("sliding", starter_model_dir, tmp_path_factory.mktemp("all"))
    loaded = load(folder)
    window = families.FAMILIES["sliding"].config["sliding_window"]
    layers = len(loaded.model.layers)
    loaded.model.make_cache = lambda: [RotatingKVCache(max_size=window) for _ in range(layers)]
    return loaded


def test_a_model_of_sliding_windows_alone_saves_checkpoints_alone(all_sliding_model):
    never_closed, kept = started(all_sliding_model, 2)
    expected, _ = turn(never_closed, kept, "so what now")
    closed, conversation_id = started(all_sliding_model, 2)
    entry = closed.index.conversation(conversation_id)
    assert all(type(layer) is RotatingKVCache for layer in closed.session.cache)
    # no chunks: the entry names its windows' format (this model's weights are float32)
    assert (entry.kv_format, entry.chunk_keys, len(entry.checkpoint_keys)) == ("float32", [], 2)

    reopened = ConversationEngine(open_db(), all_sliding_model)
    finished, _ = turn(reopened, conversation_id, "so what now")
    assert (finished.restore.source, finished.restore.checkpoint) == ("disk", 2)
    assert finished.text == expected.text


def test_a_quantized_chat_reopens_and_edits_from_its_checkpoints(words_model):
    """8-bit KV: the global layer's chunks are quantized (MixedKVCache), the windows
    are in the checkpoint; a reopen goes on exactly, an edit resumes a turn back."""
    quantized = TurnOptions(sampling=OPTIONS.sampling, kv=KVSettings(bits=8, group_size=32))
    never_closed = ConversationEngine(open_db(), words_model)
    kept = never_closed.store.create(words_model.name).id
    closed = ConversationEngine(open_db(), words_model)
    conversation_id = closed.store.create(words_model.name).id
    for text in (FIRST, LATER, LATER):
        list(never_closed.send(kept, text, quantized))
        list(closed.send(conversation_id, text, quantized))
    entry = closed.index.conversation(conversation_id)
    assert isinstance(closed.session.cache[2], MixedKVCache) and entry.kv_format.startswith("k8")

    expected = finished_of(never_closed.send(kept, "so what now", quantized))
    reopened = ConversationEngine(open_db(), words_model)
    finished = finished_of(reopened.send(conversation_id, "so what now", quantized))
    assert (finished.restore.source, finished.restore.checkpoint) == ("disk", 3)
    assert finished.text == expected.text

    third = reopened.store.get(conversation_id).messages[4]
    edited = finished_of(reopened.edit(third.id, "an edited third message", quantized))
    assert (edited.restore.source, edited.restore.checkpoint) == ("disk", 2)
    assert edited.stats.reused_tokens == closed.index.chunk(entry.checkpoint_keys[1])["token_end"]
    assert len(edited.text.split()) == 8
    fresh = ConversationEngine(open_db(), words_model)  # the edited chat, computed afresh
    other = fresh.store.create(words_model.name).id
    for text in (FIRST, LATER, "an edited third message"):
        recomputed = finished_of(fresh.send(other, text, quantized))
    assert edited.text == recomputed.text


def finished_of(events) -> ReplyFinished:
    return next(e for e in events if isinstance(e, ReplyFinished))


@pytest.mark.parametrize("kill", ["chunk row", "checkpoint row", "conversation row"])
def test_a_kill_during_a_save_leaves_the_turn_before_and_orphans_for_gc(
    words_model, monkeypatch, kill
):
    """Killed after a file, before its row (or before the conversation's row): the
    index still names the last turn's chunks and checkpoint, all readable; what the
    killed save wrote goes with gc; the chat reopens from the checkpoint before."""
    engine, conversation_id = started(words_model, 1)
    before = engine.index.conversation(conversation_id)
    add_chunk, set_conversation = CacheIndex.add_chunk, CacheIndex.set_conversation

    def killed_before_a_row(self, key, path, size, fingerprint, fmt, *span):
        if (fmt == SNAPSHOT) == (kill == "checkpoint row"):
            raise KeyboardInterrupt  # as a kill would stop it, after the file
        return add_chunk(self, key, path, size, fingerprint, fmt, *span)

    def killed_before_the_entry(self, entry):
        raise KeyboardInterrupt

    if kill == "conversation row":
        monkeypatch.setattr(CacheIndex, "set_conversation", killed_before_the_entry)
    else:
        monkeypatch.setattr(CacheIndex, "add_chunk", killed_before_a_row)
    with pytest.raises(KeyboardInterrupt):
        turn(engine, conversation_id, LATER)
    monkeypatch.setattr(CacheIndex, "add_chunk", add_chunk)  # not undo(): it keeps the tmp dirs
    monkeypatch.setattr(CacheIndex, "set_conversation", set_conversation)

    index = CacheIndex(open_db())
    assert index.verify() == []
    assert index.conversation(conversation_id).all_keys == before.all_keys
    removed = index.collect_garbage(orphan_age=0)
    assert removed["orphan_files"] + removed["unreferenced"] >= 1
    assert index.usage()[0] == len(before.all_keys)
    finished, _ = turn(ConversationEngine(open_db(), words_model), conversation_id, "so what now")
    assert (finished.restore.source, finished.restore.checkpoint) == ("disk", 1)
    never_closed, kept = started(words_model, 2)  # now: it would share the killed save's files
    expected, _ = turn(never_closed, kept, "so what now")
    assert finished.text == expected.text


def test_the_windows_of_a_model_computed_in_float32_are_float16_throughout(sliding_model):
    """The CPU path computes in float32 and keeps 16 bits in float16: its windows too,
    in memory, in the checkpoint (as the chunks: half float32's bytes) and restored,
    bit for bit."""
    assert "converted from float16" in sliding_model.compute.weights
    engine, conversation_id = started(sliding_model, 2)
    entry = engine.index.conversation(conversation_id)
    window = engine.session.cache[0]
    assert type(window) is MixedKVCache and window.max_size is not None
    tensors, _ = read_file(path_from_url(engine.index.chunk(entry.checkpoint_keys[-1])["url"]), {})
    assert {str(a.dtype) for a in tensors.values()} == {"float16"}

    restored = engine.kvstore.restore(entry, len(entry.tokens)).cache[0]
    assert type(restored) is MixedKVCache and restored.max_size == window.max_size
    for ours, live in zip(restored.dequantized(), window.dequantized(), strict=True):
        assert ours.dtype == mx.float16 and mx.array_equal(ours, live).item()


# A template that writes an earlier reply otherwise than the model wrote it, as
# gpt-oss's does (a "final" channel around it) and a reasoning model's (without its
# thinking): the next prompt parts from the cached tokens where the reply starts.
CHANNEL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}final: {% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def channel_model(starter_model_dir, tmp_path_factory):
    from app.engine.loading import load

    folder = families.build("sliding", starter_model_dir, tmp_path_factory.mktemp("channel"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHANNEL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return load(folder)


def test_a_template_that_rewrites_replies_resumes_from_before_the_generation_prompt(
    channel_model,
):
    engine = ConversationEngine(open_db(), channel_model)
    assert not engine.session.template.writes_replies_back
    conversation = engine.store.create(channel_model.name)
    turn(engine, conversation.id, FIRST)
    tokenizer = channel_model.tokenizer
    asked = [{"role": "user", "content": FIRST}]
    messages_end = len(tokenizer.apply_chat_template(asked, add_generation_prompt=False))
    entry = engine.index.conversation(conversation.id)
    ends = [engine.index.chunk(key)["token_end"] for key in entry.checkpoint_keys]
    assert ends == [messages_end, len(entry.tokens)]  # before "assistant\n", and the end

    reopened = ConversationEngine(open_db(), channel_model)
    finished, _ = turn(reopened, conversation.id, LATER)
    # The next prompt parts from the cache where the reply starts: it goes on from the
    # checkpoint before the first generation prompt (before, it read the whole chat).
    assert (finished.restore.source, finished.restore.checkpoint) == ("disk", 1)
    assert finished.stats.reused_tokens == messages_end
    messages = reopened.store.get(conversation.id).chat_messages()
    assert finished.text == fresh_reply(channel_model, messages[:-1], OPTIONS)

    # The engine that never closed holds the first turn's end, which it cannot cut
    # back to: it goes back to the same point in memory, its attention layers cut
    # and its windows from the checkpoint it took, to the very cache the reopened
    # engine built from the files. So does the reply asked again.
    user = reopened.store.message(finished.message_id).parent_id
    for events in (engine.edit(user, LATER, OPTIONS), engine.regenerate(conversation.id, OPTIONS)):
        again = next(e for e in list(events) if isinstance(e, ReplyFinished))
        assert again.restore.source == "memory"
        assert again.stats.reused_tokens >= messages_end
        assert again.text == finished.text
        assert_identical(engine.session.cache, reopened.session.cache)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_chat_goes_back_in_memory_to_the_cache_the_files_give(channel_model, bits):
    """Past the 16-bit window, the attention layers cut back in memory hold what the
    files rebuild: the same codes, the same 16-bit rows, the same next reply."""
    options = TurnOptions(sampling=SamplingSettings.greedy(40), kv=KVSettings(bits, 32))
    long_message = " ".join([FIRST] * 16)  # ~250 tokens: rows leave the window

    def finished(events) -> ReplyFinished:
        return next(e for e in list(events) if isinstance(e, ReplyFinished))

    engine = ConversationEngine(open_db(), channel_model)
    conversation = engine.store.create(channel_model.name)
    finished(engine.send(conversation.id, long_message, options))
    held = engine.session.cache
    assert any(layer.max_size is None and layer.quantized() > 0 for layer in held)  # global

    reopened = ConversationEngine(open_db(), channel_model)
    from_files = finished(reopened.send(conversation.id, LATER, options))
    user = reopened.store.message(from_files.message_id).parent_id
    in_memory = finished(engine.edit(user, LATER, options))
    assert (from_files.restore.source, in_memory.restore.source) == ("disk", "memory")
    assert in_memory.stats.reused_tokens == from_files.stats.reused_tokens
    assert in_memory.text == from_files.text
    assert_identical(engine.session.cache, reopened.session.cache)


def test_a_prefetch_stops_where_the_next_turn_of_a_rewriting_template_goes_on(channel_model):
    """Selecting such a chat restores up to before its last generation prompt, so that
    the message then sent starts from memory (it restored to the end, and the turn went
    to the files again for the earlier checkpoint)."""
    engine = ConversationEngine(open_db(), channel_model)
    conversation = engine.store.create(channel_model.name)
    turn(engine, conversation.id, FIRST)
    asked = [{"role": "user", "content": FIRST}]
    messages_end = len(channel_model.tokenizer.apply_chat_template(asked))

    reopened = ConversationEngine(open_db(), channel_model)
    prefetched = reopened.prefetch(conversation.id, OPTIONS.kv)
    assert (prefetched.source, prefetched.tokens) == ("disk", messages_end)
    finished, _ = turn(reopened, conversation.id, LATER)
    assert finished.restore.source == "memory"
    assert finished.stats.reused_tokens == messages_end
    assert finished.text == fresh_reply(
        channel_model, asked_then(reopened, conversation.id), OPTIONS
    )


def asked_then(engine: ConversationEngine, conversation_id: int) -> list[dict]:
    return engine.store.get(conversation_id).chat_messages()[:-1]
