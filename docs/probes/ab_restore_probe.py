"""CPU probe behind the README's "about 0.5 ms" of the thirteenth session (a restore no
longer stamps its files before the first token): a chat of about TOKENS tokens is saved,
then restored 21 times in one process, each beside a plain read of its files; the
medians. Run it alternately for two commits to compare them:

    git worktree add /tmp/before <commit>
    cp app/engine/_kvdecode*.so /tmp/before/app/engine/
    PYTHONPATH=/tmp/before .venv/bin/python docs/probes/ab_restore_probe.py MODEL_DIR 1024 before
    PYTHONPATH=$PWD .venv/bin/python docs/probes/ab_restore_probe.py MODEL_DIR 1024 after

Everything happens in a temporary folder.
"""

import gc
import os
import statistics
import sys
import tempfile
import time

folder = tempfile.mkdtemp()
for name in ("DATA", "CACHE", "CONFIG"):
    os.environ[f"REPRISE_{name}_DIR"] = os.path.join(folder, name.lower())

from app.bench.reopen import saved_chat  # noqa: E402
from app.engine import loading  # noqa: E402  (app.engine first: OpenBLAS)


def main() -> None:
    loaded = loading.load(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    label = sys.argv[3] if len(sys.argv) > 3 else ""
    entry, files, store = saved_chat(loaded, tokens)
    reads, restores = [], []
    for _ in range(21):
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
    read, restore = statistics.median(reads), statistics.median(restores)
    print(f"{label} {tokens}: read {read * 1e3:.2f} ms, restore {restore * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
