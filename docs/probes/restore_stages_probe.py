"""CPU probe behind the README's warm-restore figures (issue 14): where a restore of a
saved chat goes, stage by stage, when its files are in the page cache. A chat of
about TOKENS tokens is saved, then restored ROUNDS times in one process beside a
plain read of the same files; each stage's time is summed over a restore's calls
(stages nest: `read_file` holds `readinto`, `digest` and `parse_header`; `add` holds
`place`, which holds `empty_layers`).

    .venv/bin/python docs/probes/restore_stages_probe.py MODEL_DIR [TOKENS] [ROUNDS]

Everything happens in a temporary folder.
"""

import gc
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict

folder = tempfile.mkdtemp()
for name in ("DATA", "CACHE", "CONFIG"):
    os.environ[f"REPRISE_{name}_DIR"] = os.path.join(folder, name.lower())

from app.bench.reopen import saved_chat  # noqa: E402
from app.engine import chunkjoin, kvstore, loading  # noqa: E402  (app.engine first: OpenBLAS)
from sessions import cachefiles, chunkio  # noqa: E402

# (owner, function, label): what each stage is
STAGES = [
    (kvstore.KVStore, "_saved_rows", "index rows"),
    (kvstore, "paths_from_urls", "file URLs checked"),
    (kvstore, "read_ahead", "read-ahead hint"),
    (kvstore, "read_file", "read_file"),
    (chunkio, "parse_header", "  parse_header"),
    (chunkio, "_read_arrays", "  readinto"),
    (chunkio, "digest", "  digest (xxh3)"),
    (chunkjoin.ChunkJoin, "add", "add (checks, place)"),
    (chunkjoin.ChunkJoin, "_place", "  place (copies)"),
    (chunkjoin, "empty_layers", "    empty_layers (fill)"),
    (chunkjoin.ChunkJoin, "build", "build"),
    (cachefiles.CacheIndex, "touch", "LRU stamps (none since the thirteenth session)"),
]


def timed(seconds: dict, label: str, function):
    def call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            seconds[label] += time.perf_counter() - started

    return call


def main() -> None:
    loaded = loading.load(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    entry, files, store = saved_chat(loaded, tokens)
    size = sum(f.stat().st_size for f in files)

    seconds: dict[str, float] = defaultdict(float)
    for owner, name, label in STAGES:
        setattr(owner, name, timed(seconds, label, getattr(owner, name)))
    reads, restores = [], []
    for _ in range(rounds):
        gc.collect()
        started = time.perf_counter()
        for f in files:
            f.read_bytes()
        reads.append(time.perf_counter() - started)
        gc.collect()
        started = time.perf_counter()
        restored = store.restore(entry, len(entry.tokens))
        restores.append(time.perf_counter() - started)
        assert restored.rejected is None, restored.rejected
        del restored

    print(f"{len(entry.tokens)} tokens, {len(files)} files, {size / 1e6:.1f} MB, {rounds} rounds")
    read, restore = statistics.median(reads), statistics.median(restores)
    print(f"plain read  {read * 1e3:7.2f} ms (median)")
    print(f"restore     {restore * 1e3:7.2f} ms (median), {restore / read:.1f}x the read")
    print("stages, mean a restore:")
    for _, _, label in STAGES:
        print(f"  {label:26} {seconds[label] / rounds * 1e3:6.2f} ms")


if __name__ == "__main__":
    main()
