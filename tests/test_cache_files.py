"""The KV cache on disk, on the tiny model: save, restore, share, reject, evict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from safetensors.numpy import save_file
from tampering import rewrite_chunk

from app.engine import stored_arrays
from app.engine.cache_keys import describe_cache
from app.engine.chat import ChatSession
from app.engine.conversation import CacheSaved, ConversationEngine, ReplyFinished, TurnOptions
from app.engine.generation import KVSettings, SamplingSettings
from app.service.preferences import KV_CHOICES
from sessions.cachefiles import CacheIndex, path_from_url, read_file, write_file
from sessions.db import open_db

CHUNK = 16
OPTIONS = TurnOptions(sampling=SamplingSettings.greedy(10))


def new_engine(loaded, **kwargs) -> ConversationEngine:
    """An engine with a fresh in-memory state, as in a new process."""
    return ConversationEngine(open_db(), loaded, chunk_tokens=CHUNK, **kwargs)


def turn(engine, conversation_id, text, options=OPTIONS) -> tuple[ReplyFinished, CacheSaved]:
    events = list(engine.send(conversation_id, text, options))
    finished = next(e for e in events if isinstance(e, ReplyFinished))
    saved = next(e for e in events if isinstance(e, CacheSaved))
    return finished, saved


def fresh_reply(loaded, engine, conversation_id, options=OPTIONS, known=()) -> str:
    """The reply computed with no cache at all, for the branch up to the last user message,
    from the same prompt tokens (`known`: the saved tokens the engine kept as they were)."""
    messages = engine.store.get(conversation_id).chat_messages()[:-1]
    session = ChatSession(loaded)
    prompt = session.render(messages, known=known)
    *_, finished = session.generate(prompt, sampling=options.sampling, kv=options.kv)
    return finished.text


@pytest.fixture
def saved_conversation(tiny_model):
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    for text in ("hello there", "tell me more", "and then what happened"):
        turn(engine, conversation.id, text)
    return conversation.id


def chunk_rows(conversation_id) -> list[dict]:
    index = CacheIndex(open_db())
    return [index.chunk(k) for k in index.conversation(conversation_id).chunk_keys]


def test_reopening_restores_from_disk_and_matches_a_fresh_computation(
    tiny_model, saved_conversation, reading
):
    engine = new_engine(tiny_model)
    saved_tokens = engine.index.conversation(saved_conversation).tokens
    finished, _ = turn(engine, saved_conversation, "one more question")
    info = finished.restore
    assert info.source == "disk" and info.rejected is None
    # Everything but the new message: all the saved tokens, even where the random model's
    # bytes would not re-tokenize the same.
    assert info.tokens == finished.stats.reused_tokens == len(saved_tokens)
    assert finished.text == fresh_reply(tiny_model, engine, saved_conversation, known=saved_tokens)


def test_a_prefetched_cache_answers_from_memory_with_the_reply_of_a_fresh_computation(
    tiny_model, saved_conversation
):
    """Selecting a conversation restores its cache before the user sends: the turn then
    starts from memory, and replies as a computation with no cache does."""
    engine = new_engine(tiny_model)
    saved_tokens = engine.index.conversation(saved_conversation).tokens
    early = engine.prefetch(saved_conversation, OPTIONS.kv)
    assert early.source == "disk" and early.tokens == len(saved_tokens) and early.seconds > 0
    assert engine.session.tokens == saved_tokens
    finished, _ = turn(engine, saved_conversation, "one more question")
    assert finished.restore.source == "memory"
    assert finished.restore.tokens == finished.stats.reused_tokens == len(saved_tokens)
    assert finished.text == fresh_reply(tiny_model, engine, saved_conversation, known=saved_tokens)


def test_prefetch_of_a_chat_with_nothing_saved_says_so_and_the_turn_still_answers(tiny_model):
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    assert engine.prefetch(conversation.id, OPTIONS.kv).rejected == "no saved cache"
    finished, _ = turn(engine, conversation.id, "hello")
    assert finished.restore.source == "recompute" and finished.text


def test_a_restored_layer_has_room_for_the_next_tokens(tiny_model, saved_conversation):
    """Chunks are written into one buffer with room after them, as a live cache has:
    the first new token must not regrow (copy) the whole restored cache."""
    engine = new_engine(tiny_model)
    entry = engine.index.conversation(saved_conversation)
    result = engine.kvstore.restore(entry, len(entry.tokens))
    assert result.rejected is None and len(result.tokens) == len(entry.tokens)
    layer = result.cache[0]  # 16 bits on the CPU path: float16 rows in its bulk store
    keys = layer.bulk[0].buffers[0]
    assert layer.offset == len(entry.tokens) < keys.shape[2]
    new = mx.ones((1, keys.shape[1], 1, keys.shape[3]), mx.float32)
    layer.update_and_fetch(new, new)
    assert layer.bulk[0].buffers[0].shape == keys.shape  # written in place, not regrown
    assert layer.offset == len(entry.tokens) + 1


def test_a_turn_appends_its_own_tokens_and_rewrites_no_chunk(starter_model):
    """On a model that writes words (the rendered conversation extends the saved tokens;
    a random model's byte fragments do not survive re-rendering, DESIGN §13)."""
    engine = new_engine(starter_model)
    conversation = engine.store.create(starter_model.name)
    turn(engine, conversation.id, "a first message that is long enough to fill chunks")
    before = engine.index.conversation(conversation.id).chunk_keys
    tokens_before = len(engine.session.tokens)
    assert tokens_before % CHUNK  # the last chunk is partial: it used to be rewritten
    _, saved = turn(engine, conversation.id, "short")
    after = engine.index.conversation(conversation.id).chunk_keys
    new_tokens = len(engine.session.tokens) - tokens_before
    # Every chunk of the last save stays, the partial one too; new chunks hold the new tokens.
    assert after[: len(before)] == before and saved.report.chunks_reused == len(before)
    rows = chunk_rows(conversation.id)
    assert [r["token_end"] for r in rows][len(before) - 1] == tokens_before
    bytes_per_token = sum(r["bytes"] for r in rows) / len(engine.session.tokens)
    assert saved.report.bytes_written <= new_tokens * bytes_per_token * 1.3
    assert CacheIndex(open_db()).usage()[0] == len(after)


@pytest.mark.parametrize("bits", KV_CHOICES)
def test_a_chat_saved_in_many_appends_reopens_as_if_never_closed(starter_model, bits):
    """Chunks that ended a turn (a quantized cache's last chunk carries its 16-bit rows)
    are kept as the middle of the next save: the restored cache must still be the live one."""
    options = TurnOptions(sampling=SamplingSettings.greedy(6), kv=KVSettings(bits=bits))
    engine = new_engine(starter_model)
    conversation = engine.store.create(starter_model.name)
    for text in ("Hi!", "And?", "Go on.", "Why?"):
        _, saved = turn(engine, conversation.id, text, options)
    assert saved.report.chunks_reused > 2  # appended, not rewritten
    reopened, _ = turn(new_engine(starter_model), conversation.id, "Last one.", options)
    assert reopened.restore.source == "disk"
    user = engine.store.message(reopened.message_id).parent_id
    events = list(engine.edit(user, "Last one.", options))  # the same turn, never closed
    held = next(e for e in events if isinstance(e, ReplyFinished))
    assert held.restore.source == "memory" and reopened.text == held.text


def test_branches_and_shared_prefixes_share_chunks(tiny_model):
    engine = new_engine(tiny_model)
    first = engine.store.create(tiny_model.name)
    turn(engine, first.id, "the same long opening message for both conversations here")
    second = engine.store.create(tiny_model.name)
    _, saved = turn(engine, second.id, "the same long opening message for both conversations here")
    assert saved.report.chunks_reused >= 2 and saved.report.chunks_written <= 1

    user = engine.store.get(first.id).messages[0]
    events = list(engine.edit(user.id, "the same long opening message for both, edited", OPTIONS))
    saved = next(e for e in events if isinstance(e, CacheSaved))
    assert saved.report.chunks_reused >= 1


def corrupt(conversation_id, how):
    db = open_db()
    index = CacheIndex(db)
    entry = index.conversation(conversation_id)
    row = index.chunk(entry.chunk_keys[0])
    path = path_from_url(row["url"])
    if how == "missing file":
        path.unlink()
    elif how == "wrong model":
        db.execute("update conversation_caches set model_fingerprint = 'another'")
        db.conn.commit()
    elif how == "bad checksum":
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "relabelled dtype":  # same item size: only a checksum over the header sees it
        data = path.read_bytes()
        length = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + length])
        same_size = {"F32": "I32", "I32": "F32", "F16": "U16", "U16": "F16", "U32": "F32"}
        keys = next(name for name in header if name.endswith(".k.0"))
        header[keys]["dtype"] = same_size[header[keys]["dtype"]]
        text = json.dumps(header).encode()
        path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif how in ("unknown class", "wrong shape"):
        tensors, metadata = read_file(path, {})
        if how == "unknown class":
            metadata["classes"] = json.dumps(["os.system"] * len(json.loads(metadata["classes"])))
        else:
            keys = next(name for name in tensors if name.endswith(".k.0"))
            tensors[keys] = tensors[keys][..., :-1]
        write_file(path, tensors, {k: v for k, v in metadata.items() if k != "checksum"})
    elif how == "foreign file":
        save_file({"x": np.zeros(3, dtype=np.float32)}, str(path))
    elif how == "outside the root":
        db.execute(
            "update cache_chunks set url = 'file:///etc/hostname' where key = ?", [row["key"]]
        )
        db.conn.commit()
    elif how == "not a file URL":
        db.execute(
            "update cache_chunks set url = 'http://example.com/x' where key = ?", [row["key"]]
        )
        db.conn.commit()


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("missing file", "file missing"),
        ("wrong model", "different model"),
        ("bad checksum", "checksum mismatch"),
        ("relabelled dtype", "checksum mismatch"),
        ("truncated", "unreadable"),
        ("unknown class", "unknown cache class"),
        ("wrong shape", "wrong shape"),
        ("foreign file", "not a Reprise cache file"),
        ("outside the root", "outside the cache folder"),
        ("not a file URL", "not a local file URL"),
    ],
)
def test_a_bad_cache_is_not_used_and_the_turn_recomputes(
    tiny_model, saved_conversation, how, reason, reading
):
    corrupt(saved_conversation, how)
    engine = new_engine(tiny_model)
    finished, _ = turn(engine, saved_conversation, "are you still there")
    assert finished.restore.source == "recompute"
    assert reason in finished.restore.rejected
    assert finished.stats.reused_tokens == 0
    assert finished.text == fresh_reply(tiny_model, engine, saved_conversation)
    # Nothing was lost: every message is still there.
    assert len(engine.store.get(saved_conversation).messages) == 8


def test_the_first_bad_chunk_in_order_gives_the_reason(tiny_model, saved_conversation, reading):
    """Files read ahead fail at their turn: a damaged second chunk is the reason even
    when the third is missing, and nothing of the cache is used."""
    index = CacheIndex(open_db())
    keys = index.conversation(saved_conversation).chunk_keys
    assert len(keys) >= 3
    second, third = (path_from_url(index.chunk(key)["url"]) for key in keys[1:3])
    data = bytearray(second.read_bytes())
    data[-5] ^= 0xFF
    second.write_bytes(bytes(data))
    third.unlink()
    engine = new_engine(tiny_model)
    finished, _ = turn(engine, saved_conversation, "are you still there")
    assert finished.restore.source == "recompute"
    assert "checksum mismatch" in finished.restore.rejected


def test_reading_in_threads_keeps_the_order_and_stops_at_a_failure():
    started = []

    def read(i):
        started.append(i)
        if i == 3:
            raise ValueError("three")
        return i * 10

    results = stored_arrays.read_in_threads(read, [(i,) for i in range(50)], 4)
    assert [next(results) for _ in range(3)] == [0, 10, 20]
    with pytest.raises(ValueError, match="three"):
        next(results)
    assert max(started) < 3 + 4 + 1  # none started beyond the window


def test_to_device_gives_back_each_array_as_it_was():
    from app.engine.stored_arrays import to_device

    arrays = {
        "0.k.0": np.arange(24, dtype=np.uint16).reshape(1, 2, 3, 4),
        "0.k.1": np.linspace(0, 1, 6, dtype=np.float32).reshape(1, 2, 3, 1),
        "1.v.0": np.arange(5, dtype=np.uint32),
    }
    loaded = to_device(arrays)
    assert set(loaded) == set(arrays)
    for name, array in arrays.items():
        assert loaded[name].shape == array.shape
        assert np.array_equal(np.array(loaded[name]), array)
    assert to_device({}) == {}


def test_a_changed_history_reuses_only_what_still_matches(tiny_model, saved_conversation):
    db = open_db()
    first_reply = ConversationEngine(db, tiny_model).store.get(saved_conversation).messages[1]
    db["messages"].update(first_reply.id, {"content": "something else entirely"})
    engine = new_engine(tiny_model)
    saved_tokens = engine.index.conversation(saved_conversation).tokens
    finished, _ = turn(engine, saved_conversation, "next")
    assert finished.restore.source == "disk"
    assert (
        0
        < finished.stats.reused_tokens
        < len(engine.session.render(engine.store.get(saved_conversation).chat_messages()[:2]))
    )
    assert finished.text == fresh_reply(tiny_model, engine, saved_conversation, known=saved_tokens)


def test_verify_and_gc(tiny_model, saved_conversation, app_dirs):
    index = CacheIndex(open_db())
    assert index.verify() == []
    corrupt(saved_conversation, "bad checksum")
    bad = index.verify()
    assert len(bad) == 1 and bad[0]["reason"].startswith("checksum mismatch")

    # Left by writers that are gone: a pid that no longer runs, and one an hour old.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (index.root / "ab").mkdir(exist_ok=True)
    stray = index.root / "ab" / f".tmp-{dead.pid}-abc.safetensors"
    stray.write_bytes(b"half a file")
    old_stray = index.root / "ab" / f".tmp-{os.getpid()}-old.safetensors"
    old_stray.write_bytes(b"half a file")
    # A live writer's temp file, and a file whose row another process is about to add.
    live = index.root / "ab" / f".tmp-{os.getpid()}-abd.safetensors"
    live.write_bytes(b"being written")
    fresh = index.root / "ab" / "abfresh.safetensors"
    fresh.write_bytes(b"x")
    orphan = index.root / "cd" / "cdorphan.safetensors"
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"x")
    an_hour_ago = time.time() - 3600
    for path in (old_stray, orphan):
        os.utime(path, (an_hour_ago, an_hour_ago))
    removed = index.collect_garbage()
    assert removed["temp_files"] == 2 and removed["orphan_files"] == 1
    assert not stray.exists() and not old_stray.exists() and not orphan.exists()
    assert live.exists() and fresh.exists()


def test_the_cpu_paths_16_bits_are_float16_in_memory_on_disk_and_restored(
    tiny_model, saved_conversation
):
    """The CPU path computes in float32, and keeps a 16-bit cache in float16: half
    float32's memory, the bytes its files hold, and a restore that converts nothing
    (the restored rows are the live ones, bit for bit)."""
    engine = new_engine(tiny_model)
    turn(engine, saved_conversation, "one more question")
    live = engine.session.cache
    tokens = len(engine.session.tokens)
    assert tiny_model.cache_layer_shapes[0].dtype == mx.float32  # what the model computes in
    plain = make_prompt_cache(tiny_model.model)  # mlx-lm's cache of the same tokens
    tiny_model.model(mx.array(engine.session.tokens)[None], cache=plain)
    assert engine.session.kv_bytes() == sum(layer.nbytes for layer in plain) / 2
    assert describe_cache(live) == "16-bit"

    entry = engine.index.conversation(saved_conversation)
    for key in entry.chunk_keys:
        tensors, _ = read_file(path_from_url(engine.index.chunk(key)["url"]), {})
        assert {str(t.dtype) for t in tensors.values()} == {"float16"}
    result = engine.kvstore.restore(entry, len(entry.tokens))
    assert result.rejected is None and len(result.tokens) == tokens
    for restored, held in zip(result.cache, live, strict=True):
        for part in (0, 1):
            a, b = (layer.reference_read(part, mx.float16) for layer in (restored, held))
            assert a.dtype == mx.float16 and np.array_equal(np.asarray(a), np.asarray(b))


def test_a_16_bit_cache_an_earlier_version_saved_from_float32_still_reopens(tiny_model):
    """Before, the CPU path held float32 and saved it in the model's own 16 bits
    ("float16" or "bfloat16"): such a cache is restored (widened) and goes on in float16."""
    engine = new_engine(tiny_model)
    conversation = engine.store.create(tiny_model.name)
    turn(engine, conversation.id, "hello there")
    tokens = list(engine.session.tokens)
    plain = make_prompt_cache(tiny_model.model)  # mlx-lm's float32 cache, as it was
    tiny_model.model(mx.array(tokens)[None], cache=plain)
    mx.eval([layer.state for layer in plain])
    engine.kvstore.save(conversation.id, tokens, plain)
    entry = engine.index.conversation(conversation.id)
    assert entry.kv_format == engine.kvstore.sixteen_bit

    reopened = new_engine(tiny_model)
    finished, _ = turn(reopened, conversation.id, "tell me more")
    assert finished.restore.source == "disk" and finished.restore.tokens == len(tokens)
    assert describe_cache(reopened.session.cache) == "16-bit"  # float16 from then on


def test_a_regenerate_from_memory_reports_the_tokens_it_keeps(tiny_model, saved_conversation):
    """The status bar's "Continuing: N tokens already in memory" is what the turn reuses,
    not the whole cache: a regenerate cuts the old reply off."""
    engine = new_engine(tiny_model)
    turn(engine, saved_conversation, "one more question")
    held = len(engine.session.tokens)
    events = list(engine.regenerate(saved_conversation, OPTIONS))
    finished = next(e for e in events if isinstance(e, ReplyFinished))
    assert finished.restore.source == "memory"
    assert finished.restore.tokens == finished.stats.reused_tokens < held


def test_float16_rows_rewritten_as_bfloat16_still_get_a_reply(tiny_model, saved_conversation):
    """A saved 16-bit cache's rows rewritten as bfloat16 bits (another program, signed
    anew): the reopened turn reads them as such and replies, no traceback (numpy, which
    reads float16 rows, has no bfloat16)."""
    index = CacheIndex(open_db())

    def as_bfloat16(tensors: dict, _metadata: dict) -> None:
        for name in [n for n in tensors if n.endswith((".k.0", ".v.0"))]:
            tensors[name] = tensors[name].view(np.uint16)

    for key in index.conversation(saved_conversation).chunk_keys:
        rewrite_chunk(index, key, as_bfloat16)
    finished, _ = turn(new_engine(tiny_model), saved_conversation, "one more question")
    assert finished.restore.source == "disk" and finished.stats.generated_tokens > 0


def test_eviction_takes_a_conversations_chunks_from_its_end(tiny_model, saved_conversation):
    """Chunks a restore used together share one stamp; eviction then takes the later
    ones first, so what stays is the start of the conversation and still restores
    (a chunk taken from the middle would leave every one after it unusable)."""
    index = CacheIndex(open_db())
    rows = chunk_rows(saved_conversation)
    assert len(rows) >= 5
    index.touch([row["key"] for row in rows])  # as a restore leaves them
    kept = len(rows) // 2
    index.evict_to_budget(sum(row["bytes"] for row in rows[:kept]))

    assert [index.chunk(row["key"]) is not None for row in rows] == (
        [True] * kept + [False] * (len(rows) - kept)
    )
    finished, _ = turn(new_engine(tiny_model), saved_conversation, "and after that?")
    assert finished.restore.source == "disk"
    assert finished.stats.reused_tokens == rows[kept - 1]["token_end"]
