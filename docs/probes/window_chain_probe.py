"""Probe behind the README's figures for checkpoints that share window rows (issue 14): what
a restore pays for reading a window from a chain of checkpoints rather than from one.

A `bench reopen --shape` model of random weights gets ~`tokens` of history and then TURNS
short turns (each one token long, so that the window spans many checkpoints), once as the
app saves them (each checkpoint the rows since the one before) and once with every
checkpoint holding its windows whole, as before; then each chat is restored ROUNDS times
in one process, alternating, medians. Run from the project root (on the GPU machine with
PYTHONPATH set instead of the venv):

    .venv/bin/python docs/probes/window_chain_probe.py gemma3-1b 4096 MODEL_DIR \
        [TURNS] [ROUNDS] [BITS]

MODEL_DIR: an imported starter model (for its tokenizer); BITS: the KV preference, 8 or 4
(default: 16 bits).
"""

import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def main() -> None:
    shape, tokens, tokenizer_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    turns = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 9
    bits = int(sys.argv[6]) if len(sys.argv) > 6 else None
    scratch = tempfile.mkdtemp()
    for kind in ("DATA", "CACHE", "CONFIG"):
        os.environ[f"REPRISE_{kind}_DIR"] = f"{scratch}/{kind.lower()}"
    import app.engine  # noqa: F401 (OpenBLAS before mlx)
    from app.bench import shapes
    from app.bench.reopen import ONE_TOKEN, build_history, run_turn
    from app.engine import checkpoint_chain, loading
    from app.engine.conversation import ConversationEngine
    from app.engine.generation import KVSettings
    from sessions.db import open_db

    loaded = loading.load(shapes.model_folder(shape, tokenizer_dir, Path(scratch)))
    as_the_app_saves = checkpoint_chain.parent
    options = replace(ONE_TOKEN, kv=KVSettings(bits, 64))
    chats = {}
    for kind in ("rows since the last", "whole windows"):
        checkpoint_chain.parent = as_the_app_saves if kind[0] == "r" else lambda points: None
        for folder in ("DATA", "CACHE"):  # files of their own: equal tokens share files
            os.environ[f"REPRISE_{folder}_DIR"] = f"{scratch}/{kind[0]}/{folder.lower()}"
        engine = ConversationEngine(open_db(), loaded)
        conversation = engine.store.create(f"{loaded.name} {kind}")
        build_history(engine, conversation.id, tokens)
        written = 0
        for n in range(turns):
            _, saved = run_turn(engine, conversation.id, f"ok {n}", options)
            written += saved.report.bytes_written
        entry = engine.index.conversation(conversation.id)
        chats[kind] = (engine.kvstore, entry)
        files = len(entry.checkpoint_keys)
        kept = sum(engine.index.chunk(key)["bytes"] for key in entry.checkpoint_keys)
        print(
            f"{kind}: {len(entry.tokens)} tokens, {turns} turns wrote {written / 1e6:.2f} MB,"
            f" {files} checkpoints kept, {kept / 1e6:.2f} MB",
            flush=True,
        )
    checkpoint_chain.parent = as_the_app_saves
    seconds: dict[str, list[float]] = {kind: [] for kind in chats}
    for _ in range(rounds):
        for kind, (store, entry) in chats.items():
            started = time.perf_counter()
            restored = store.restore(entry, len(entry.tokens))
            seconds[kind].append(time.perf_counter() - started)
            assert restored.cache is not None, restored.rejected
            del restored
    for kind, times in seconds.items():
        store, entry = chats[kind]
        print(
            f"  {kind}: restore median {1e3 * statistics.median(times):.1f} ms"
            f" ({store.bytes_to_read(entry, len(entry.tokens)) / 1e6:.2f} MB)",
            flush=True,
        )


if __name__ == "__main__":
    main()
