"""CPU probe behind the README's host-memory figures (issue 14): a 4k-token chat of the
starter is saved, then restored eight times in one process, each restore's cache
dropped before the next, beside a plain read of the same files. Run it once with
glibc's defaults and once as the engine sets them (`app.engine.host_memory`):

    REPRISE_HOST_MEMORY=system .venv/bin/python docs/probes/host_restore_probe.py MODEL_DIR
    .venv/bin/python docs/probes/host_restore_probe.py MODEL_DIR

Everything happens in a temporary folder.
"""

import gc
import os
import sys
import tempfile
import time

folder = tempfile.mkdtemp()
for name in ("DATA", "CACHE", "CONFIG"):
    os.environ[f"REPRISE_{name}_DIR"] = os.path.join(folder, name.lower())

from app.bench.reopen import build_history, cache_files, run_turn  # noqa: E402
from app.engine import host_memory, loading  # noqa: E402  (app.engine first: OpenBLAS)
from app.engine.conversation import ConversationEngine  # noqa: E402
from sessions.db import open_db  # noqa: E402


def main() -> None:
    loaded = loading.load(sys.argv[1])
    builder = ConversationEngine(open_db(), loaded)
    conversation = builder.store.create(loaded.name)
    build_history(builder, conversation.id, 4096)
    run_turn(builder, conversation.id, "Summarise this.")
    entry = builder.index.conversation(conversation.id)
    files = cache_files(builder, conversation.id)
    size = sum(f.stat().st_size for f in files)
    store = ConversationEngine(open_db(), loaded).kvstore
    reads, restores = [], []
    for _ in range(8):
        started = time.perf_counter()
        for f in files:
            f.read_bytes()
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        restored = store.restore(entry, len(entry.tokens))
        restores.append(time.perf_counter() - started)
        del restored
        gc.collect()
    kept = "kept for reuse" if host_memory.kept else "glibc's defaults"
    print(f"{len(entry.tokens)} tokens, {len(files)} files, {size / 1e6:.1f} MB; memory: {kept}")
    print("plain read ms:", " ".join(f"{s * 1e3:.1f}" for s in reads))
    print("restore ms:   ", " ".join(f"{s * 1e3:.1f}" for s in restores))


if __name__ == "__main__":
    main()
