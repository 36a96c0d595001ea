"""`reprise bench reopen`: continuing a saved conversation vs recomputing it.

For each history length, one run builds a conversation of about that many
tokens, saves its cache, then measures side by side:

- time to first token when a new engine (as after a restart) restores the
  cache from disk, against recomputing the whole history with no cache;
- the restore's time against a plain read of the same files' bytes;
- bytes the reopened turn wrote against the KV bytes of the tokens it added;
- time to first token after a prefetch (the restore a selection starts while the
  user types) against an engine that never closed, same prompt, same cached prefix;
- the reopen planner's choice (from the bandwidth and prefill rates measured by the
  rows before, their recomputes included, as an app learns from its own) against the
  faster of the two paths.

Everything happens in a temporary folder; the user's data is not touched.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from app.bench import llama_cpp_peer, shapes
from app.engine import loading, models
from app.engine.chat import ChatSession
from app.engine.codecs import stored_dtype
from app.engine.conversation import CacheSaved, ConversationEngine, ReplyFinished, TurnOptions
from app.engine.errors import UserError
from app.engine.generation import KVSettings, SamplingSettings
from app.engine.kvscheme import parse_format
from app.engine.planner import READ_BANDWIDTH
from app.resource_files import resource
from sessions import paths
from sessions.cachefiles import path_from_url
from sessions.db import open_db
from sessions.measurements import Measurements

TEXT = resource("text/ordinary-english.txt")
ONE_TOKEN = TurnOptions(sampling=SamplingSettings.greedy(1))


def build_history(engine: ConversationEngine, conversation_id: int, target: int) -> None:
    """Alternate user paragraphs and assistant echoes until the prompt is ~`target` tokens."""
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if p.strip()]
    parent = None
    i = 0
    while True:
        messages = engine.store.get(conversation_id).chat_messages()
        if messages and len(engine.session.render(messages)) >= target:
            return
        text = paragraphs[i % len(paragraphs)]
        role = "user" if i % 2 == 0 else "assistant"
        parent = engine.store.add_message(conversation_id, role, text, parent_id=parent).id
        i += 1


def run_turn(
    engine, conversation_id, text, options: TurnOptions = ONE_TOKEN
) -> tuple[ReplyFinished, CacheSaved]:
    events = list(engine.send(conversation_id, text, options))
    return events[-2], events[-1]


Peer = Callable[[list[int], list[int]], dict]  # (history, new tokens) -> its figures


def measure(
    loaded: loading.LoadedModel,
    target: int,
    peer: Peer | None = None,
    cold: bool = False,
    kv: KVSettings = ONE_TOKEN.kv,
) -> dict:
    """One history length's row. `cold`: every read of the cache files (the plain read,
    the restore, the prefetch) starts with their pages dropped from the OS's cache, as
    when a conversation is reopened days later. `kv`: the KV preference every turn
    uses, so the cache is saved (and restored) in its format."""
    options = replace(ONE_TOKEN, kv=kv)
    db = open_db()
    builder = ConversationEngine(db, loaded)
    # The builder prefills the whole history at once, where an app's history grows turn
    # by turn: what it times is not the planner's to know (its own measurements file).
    builder.planner.measurements = Measurements(open_db(paths.data_dir() / "bench-builder.db"))
    conversation = builder.store.create(loaded.name)
    build_history(builder, conversation.id, target)
    run_turn(builder, conversation.id, "Summarise this.", options)  # prefill all, save
    entry = builder.index.conversation(conversation.id)
    files = cache_files(builder, conversation.id)
    cache_bytes = sum(f.stat().st_size for f in files)

    evicted = cold and evict(files)
    started = time.perf_counter()
    for f in files:
        f.read_bytes()
    raw_read_s = time.perf_counter() - started

    # A restart leaves no cache in memory: the reopened engine's restore gets the memory
    # the builder's cache had, as an app's restore does (it drops the cache it held first).
    builder.session.reset()
    reopened = ConversationEngine(open_db(), loaded)  # a new engine, as after a restart
    reopened.races.enabled = False  # the restore itself, timed
    # Measure the restore whichever path the planner would take; its choice is scored below.
    reopened.planner.measurements.forget(READ_BANDWIDTH)
    if cold:
        evict(files)
    restored, saved = run_turn(reopened, conversation.id, "And in one word?", options)
    info = restored.restore
    assert info.source == "disk", info

    prompt = reopened.session.render(reopened.store.get(conversation.id).chat_messages()[:-1])
    fresh = ChatSession(loaded)
    *_, recomputed = fresh.generate(prompt, sampling=options.sampling, kv=kv)
    user = reopened.store.message(restored.message_id).parent_id
    planned_turn = measure_planned(loaded, conversation.id, user, options, cold)
    reopened.planner.learn_prefill_rate(recomputed.stats)  # for the rows after, as an app would
    repeated = measure_restores(reopened, conversation.id, cold)

    new_tokens = restored.stats.prompt_tokens + 1 - info.tokens
    kv_bytes_per_token = cache_bytes / len(entry.tokens)
    reopened_prompt = reopened.session.tokens[: restored.stats.prompt_tokens]
    peer_row = peer(reopened_prompt[: info.tokens], reopened_prompt[info.tokens :]) if peer else {}
    if cold:
        evict(cache_files(reopened, conversation.id))
    prefetched = measure_prefetch(loaded, reopened, conversation.id, options)
    follow_ups = measure_follow_ups(loaded, conversation.id, options, kv_bytes_per_token)
    rows_per_token = row_bytes_per_token(loaded, entry.kv_format)
    added = follow_ups.pop("follow_ups_tokens_added")
    return {
        "history_tokens": len(entry.tokens),
        "kv_format": entry.kv_format,
        "cache_bytes": cache_bytes,
        "cold": evicted,
        "restore_s": info.seconds,
        "restore_bytes": info.bytes_read,
        "restore_mb_s": info.bytes_read / info.seconds / 1e6,
        "raw_read_s": raw_read_s,
        "raw_read_mb_s": cache_bytes / raw_read_s / 1e6,
        "restore_vs_raw_read": info.seconds / raw_read_s,
        **repeated,
        "ttft_restore_s": restored.ttft_s,  # the restore included: what the user waits
        "ttft_recompute_s": recomputed.stats.ttft_s,
        "reopen_speedup": recomputed.stats.ttft_s / restored.ttft_s,
        "turn_new_tokens": new_tokens,
        "turn_bytes_written": saved.report.bytes_written,
        "written_vs_new_kv_bytes": saved.report.bytes_written / (new_tokens * kv_bytes_per_token),
        "new_rows_bytes_per_token": rows_per_token,
        "written_vs_new_rows_bytes": saved.report.bytes_written / (new_tokens * rows_per_token),
        "follow_ups_written_vs_new_rows_bytes": follow_ups["follow_ups_bytes_written"]
        / (added * rows_per_token),
        **planned_turn,
        "planner_vs_faster": planned_turn["ttft_planned_s"]
        / min(restored.ttft_s, recomputed.stats.ttft_s),
        **prefetched,
        **follow_ups,
        **peer_row,
    }


def cache_files(engine: ConversationEngine, conversation_id: int) -> list[Path]:
    entry = engine.index.conversation(conversation_id)
    return [path_from_url(engine.index.chunk(k)["url"]) for k in entry.all_keys]


def saved_chat(loaded: loading.LoadedModel, tokens: int) -> tuple:
    """For the restore probes (docs/probes/): a chat of about `tokens` tokens, saved; its
    index entry, its files, and the store of a second engine to restore it with (as
    after a restart: the first engine lets its cache's memory go)."""
    builder = ConversationEngine(open_db(), loaded)
    conversation = builder.store.create(loaded.name)
    build_history(builder, conversation.id, tokens)
    run_turn(builder, conversation.id, "Summarise this.")
    entry = builder.index.conversation(conversation.id)
    files = cache_files(builder, conversation.id)
    store = ConversationEngine(open_db(), loaded).kvstore
    builder.session.reset()
    return entry, files, store


def evict(files: list[Path]) -> bool:
    """Drop `files`' pages from the OS's page cache, so that the next read comes from the
    disk; False where the OS offers no way (posix_fadvise is Linux's)."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def measure_restores(engine: ConversationEngine, conversation_id: int, cold: bool) -> dict:
    """The chat's saved cache restored `RESTORE_ROUNDS` times, each beside a plain read of
    its files (cold: both from the disk), alternated; the medians. One restore of a few
    milliseconds, as the row's `restore_s` is, moves by as much as the ratio's goal."""
    entry = engine.index.conversation(conversation_id)
    files = cache_files(engine, conversation_id)
    reads, restores = [], []
    for _ in range(RESTORE_ROUNDS):
        if cold:
            evict(files)
        started = time.perf_counter()
        for f in files:
            f.read_bytes()
        reads.append(time.perf_counter() - started)
        if cold:
            evict(files)
        restored = engine.kvstore.restore(entry, len(entry.tokens))
        assert restored.rejected is None, restored.rejected
        restores.append(restored.seconds)
        del restored
    read, restore = statistics.median(reads), statistics.median(restores)
    return {
        "restore_median_s": restore,
        "raw_read_median_s": read,
        "restore_vs_raw_read_median": restore / read,
    }


def measure_planned(
    loaded, conversation_id: int, user_message_id: int, options: TurnOptions, cold: bool
) -> dict:
    """The reopened turn as the app takes it, after a restart: where the planner sends it
    or, at a size it has not measured where the GPU has memory of its own, the race of
    restoring against recomputing (app/engine/restore_race.py). The prompt is the one
    restored and recomputed above (an edit of the same message)."""
    engine = ConversationEngine(open_db(), loaded)
    if cold:
        evict(cache_files(engine, conversation_id))
    events = list(engine.edit(user_message_id, "And in one word?", options))
    finished = events[-2]
    source = finished.restore.source
    trace = engine.races.last_trace if finished.restore.raced else None
    return {
        # what the turn's choice went by (the restore timed above taught the read's rate)
        "planner_estimates_s": {
            "restore": finished.restore.estimate_restore_s,
            "recompute": finished.restore.estimate_recompute_s,
        },
        "planner_choice": ("race, " if finished.restore.raced else "")
        + ("restore" if source == "disk" else "recompute"),
        "ttft_planned_s": finished.ttft_s,
        # per decision: seconds in, tokens prefilled, bytes read, read's expected end,
        # copy's estimate, prefill's expected end
        "race_trace": [[round(x, 4) if isinstance(x, float) else x for x in t] for t in trace]
        if trace
        else None,
    }


def measure_prefetch(
    loaded, never_closed: ConversationEngine, conversation_id: int, options: TurnOptions
) -> dict:
    """A new engine prefetches the saved cache, then answers a new message; the engine
    that never closed answers the same message (an edit: the same parent, the same
    prompt) from the cache it holds."""
    prefetcher = ConversationEngine(open_db(), loaded)
    early = prefetcher.prefetch(conversation_id, options.kv)
    assert early.source == "disk", early
    after, _ = run_turn(prefetcher, conversation_id, "And in two words?", options)
    assert after.restore.source == "memory", after.restore
    user = prefetcher.store.message(after.message_id).parent_id
    events = list(never_closed.edit(user, "And in two words?", options))
    held = events[-2]
    assert held.restore.source == "memory", held.restore
    return {
        "prefetch_s": early.seconds,
        "ttft_prefetched_s": after.ttft_s,
        "ttft_in_memory_s": held.ttft_s,
    }


def measure_follow_ups(
    loaded, conversation_id: int, options: TurnOptions, kv_bytes_per_token: float
) -> dict:
    """What a chat that goes on writes: `FOLLOW_UPS` short turns, each saved, their bytes
    written against the KV bytes of the tokens they added (the one turn measured above
    may or may not be the one that writes a chunk again: over several, it averages)."""
    engine = ConversationEngine(open_db(), loaded)
    written = added = 0
    for n in range(FOLLOW_UPS):
        before = len(engine.index.conversation(conversation_id).tokens)
        _, saved = run_turn(engine, conversation_id, f"And in {n + 3} words?", options)
        written += saved.report.bytes_written
        added += len(engine.index.conversation(conversation_id).tokens) - before
    return {
        "follow_ups": FOLLOW_UPS,
        "follow_ups_bytes_written": written,
        "follow_ups_written_vs_new_kv_bytes": written / (added * kv_bytes_per_token),
        "follow_ups_tokens_added": added,
    }


def row_bytes_per_token(loaded, fmt: str) -> float:
    """What one token's keys and values take in every layer that holds them, saved as
    `fmt`: the KV a new token adds, in a sliding window's layers too (its row stays
    saved until the window has moved past it). For a model of full attention about the
    cache's bytes per token (`written_vs_new_kv_bytes`); for one with windows more, as
    they hold a bounded part of the history."""
    dtype = stored_dtype(fmt)
    try:
        bits = dtype.size * 8 if dtype is not None else parse_format(fmt).bits_per_value()
    except ValueError:  # windows alone: checkpoints only, in 16 bits
        bits = 16
    shapes = [shape for _, shape in loaded.attention_shapes if shape is not None]
    return sum(shape.heads * (shape.key_dim + shape.value_dim) for shape in shapes) * bits / 8


def main(args: argparse.Namespace) -> int:
    rows, skipped = [], []
    peer = _peer(args)
    kv = KVSettings(args.kv_bits, args.kv_group_size)
    with tempfile.TemporaryDirectory(prefix="reprise-bench-") as scratch:
        model_dir = _model_dir(args, Path(scratch))
        loaded = loading.load(model_dir)
        if not args.json:
            print(
                f"model: {model_dir.name}   engine path: {loaded.compute.describe()}   "
                f"KV: {kv.describe()}"
            )
            print(HEADER, flush=True)
        os.environ["REPRISE_DATA_DIR"] = str(Path(scratch) / "data")
        os.environ["REPRISE_CACHE_DIR"] = str(Path(scratch) / "cache")
        for target in args.tokens:
            if target + ROOM_FOR_A_TURN > loaded.context_length:
                note = f"{target} tokens: beyond the model's context ({loaded.context_length})"
                skipped.append(note)
                print(f"skipped: {note}", file=sys.stderr, flush=True)
                _append_row(args.rows_to, {"target": target, "skipped": note})
                continue
            rows.append(measure(loaded, target, peer, args.cold, kv))
            _append_row(args.rows_to, {"model": model_dir.name, "target": target, **rows[-1]})
            if not args.json:
                print(row_text(rows[-1]), flush=True)  # each size as soon as it is measured
    if args.json:
        result = {
            "model": model_dir.name,
            "compute": loaded.compute.describe(),
            "kv": kv.describe(),
            "rows": rows,
        }
        print(json.dumps({**result, "skipped": skipped}, indent=2))
    return 0


def _append_row(path: Path | None, row: dict) -> None:
    """`--rows-to`: one JSON line per size, written when measured, so that a run cut
    short (a time limit on a borrowed GPU) keeps every size it finished."""
    if path is not None:
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _model_dir(args: argparse.Namespace, scratch: Path) -> Path:
    """The model to measure: an installed one, or with `--shape` a real shape with random
    weights written into `scratch` (the starter model lends its tokenizer)."""
    tokenizer_model = models.resolve(args.model, paths.models_dir())
    if not args.shape:
        return tokenizer_model
    if args.peer:
        raise UserError("--peer reads a GGUF of the same model: it cannot run with --shape")
    return shapes.model_folder(args.shape, tokenizer_model, scratch / "models")


def _peer(args: argparse.Namespace):
    """The llama.cpp measurement for `--peer llama.cpp`, or None."""
    gguf = llama_cpp_peer.gguf_for(args.peer, args.peer_gguf)
    if gguf is None:
        return None

    def run(history: list[int], new: list[int]) -> dict:
        return llama_cpp_peer.measure(gguf, history, new, llama_cpp_peer.threads())

    return run


# A history is built up to the target, then short turns are asked: two, and the follow-ups.
ROOM_FOR_A_TURN = 256
FOLLOW_UPS = 8
RESTORE_ROUNDS = 5
HEADER = (
    f"{'history':>8} {'cache MB':>9} {'restore':>8} {'MB/s':>6} {'raw read MB/s':>14} "
    f"{'TTFT restore':>13} {'TTFT recompute':>15} "
    f"{'speedup':>8} {'restore/raw read':>17} {'written/new KV':>15} "
    f"{'TTFT prefetched':>16} {'TTFT in memory':>15} {'planner':>22} "
    f"{'follow-ups written/new KV':>26} {'/new rows':>10} {'restore/raw read, median':>25}"
)


def row_text(r: dict) -> str:
    peer = f"   llama.cpp TTFT {r['llama_cpp_ttft_s']:.3f}s" if "llama_cpp_ttft_s" in r else ""
    return (
        f"{r['history_tokens']:8} {r['cache_bytes'] / 1e6:9.1f} {r['restore_s']:7.3f}s "
        f"{r['restore_mb_s']:6.0f} {r['raw_read_mb_s']:14.0f} {r['ttft_restore_s']:12.3f}s "
        f"{r['ttft_recompute_s']:14.3f}s {r['reopen_speedup']:7.1f}x "
        f"{r['restore_vs_raw_read']:16.2f}x {r['written_vs_new_kv_bytes']:14.2f}x "
        f"{r['ttft_prefetched_s']:15.3f}s {r['ttft_in_memory_s']:14.3f}s "
        f"{r['planner_choice']:>14} {r['planner_vs_faster']:6.2f}x "
        f"{r['follow_ups_written_vs_new_kv_bytes']:25.2f}x "
        f"{r['follow_ups_written_vs_new_rows_bytes']:9.2f}x "
        f"{r['restore_vs_raw_read_median']:24.2f}x{peer}"
    )
