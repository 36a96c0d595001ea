"""CPU probe behind the README's restore timings of 7 December (issue 14): a 4k-token chat
of the starter, saved with the KV preference BITS (8, 4, or 16 for off) and FOLLOW_UPS short
turns after it, restored ROUNDS times in one process, each restore's cache dropped before
the next; medians. With --reader-thread, each round also restores with the next chunk file
read and checked on a thread ahead (as the GPU path reads), and every kind runs twice a
round, from the page cache and from disk (the files dropped from it first). Run from the
project root, once per commit to compare:

    .venv/bin/python docs/probes/quantized_restore_probe.py MODEL_DIR 4 --follow-ups 3 --rounds 15
    .venv/bin/python docs/probes/quantized_restore_probe.py MODEL_DIR 4 --rounds 24 --reader-thread

Everything happens in a temporary folder.
"""

import argparse
import gc
import os
import statistics
import tempfile
import time
from dataclasses import replace

folder = tempfile.mkdtemp()
for name in ("DATA", "CACHE", "CONFIG"):
    os.environ[f"REPRISE_{name}_DIR"] = os.path.join(folder, name.lower())

from app.bench.reopen import ONE_TOKEN, build_history, cache_files, evict, run_turn  # noqa: E402
from app.engine import kvstore, loading, stored_arrays  # noqa: E402  (app.engine first: OpenBLAS)
from app.engine.conversation import ConversationEngine  # noqa: E402
from app.engine.generation import KVSettings  # noqa: E402
from sessions.cachefiles import read_ahead, read_file  # noqa: E402
from sessions.db import open_db  # noqa: E402

AS_THE_APP_READS = kvstore.KVStore._read_files


def reader_thread(store, paths, expected):
    """The next file read and checked on a thread while the last is joined."""
    read_ahead(paths)
    calls = list(zip(paths, expected, strict=True))
    yield from stored_arrays.read_in_threads(read_file, calls, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("bits", type=int, choices=(4, 8, 16))
    parser.add_argument("--follow-ups", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reader-thread", action="store_true")
    args = parser.parse_args()
    options = replace(ONE_TOKEN, kv=KVSettings(None if args.bits == 16 else args.bits, 64))
    loaded = loading.load(args.model)
    builder = ConversationEngine(open_db(), loaded)
    conversation = builder.store.create(loaded.name)
    build_history(builder, conversation.id, 4096)
    run_turn(builder, conversation.id, "Summarise this.", options)
    for n in range(args.follow_ups):
        run_turn(builder, conversation.id, f"And in {n + 3} words?", options)
    entry = builder.index.conversation(conversation.id)
    files = cache_files(builder, conversation.id)
    builder.session.reset()
    store = ConversationEngine(open_db(), loaded).kvstore
    kinds = [("as the app reads", AS_THE_APP_READS)]
    kinds += [("a reader thread", reader_thread)] if args.reader_thread else []
    reads = ("page cache", "disk") if args.reader_thread else ("page cache",)
    seconds: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for kind, read_files in kinds:
            kvstore.KVStore._read_files = read_files
            for read in reads:
                if read == "disk":
                    evict(files)
                started = time.perf_counter()
                restored = store.restore(entry, len(entry.tokens))
                seconds.setdefault((kind, read), []).append(time.perf_counter() - started)
                assert restored.cache is not None, restored.rejected
                del restored
                gc.collect()
    print(
        f"{len(entry.tokens)} tokens, {entry.kv_format}, {len(files)} files, {args.rounds} rounds"
    )
    for (kind, read), times in seconds.items():
        print(f"  {kind}, {read}: median {1e3 * statistics.median(times):.1f} ms")


if __name__ == "__main__":
    main()
