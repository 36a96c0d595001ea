"""CPU probe behind the README's note on reading a restore with mlx's own loader (issue 14,
twelfth session; tried and not kept): a chat of about TOKENS tokens is saved, then, ROUNDS
times, a plain read of its files, the app's restore, and the other way, alternated in one
process: each file checked and read by `mx.load` straight into mlx's memory (no zeros
written first), then one `mx.concatenate` a tensor over the chunks, with room for the next
tokens (the layers left as views of it). Medians.

    .venv/bin/python docs/probes/mlx_load_restore_probe.py MODEL_DIR [TOKENS] [ROUNDS]

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
from app.engine.cache_keys import tokens_hash  # noqa: E402
from app.engine.codecs import ChunkManifest  # noqa: E402
from sessions.chunkio import read_file  # noqa: E402

mx = loading.mx  # mlx as the app loaded it, after OpenBLAS

STEP = 256  # room for the next tokens, as the app's layers have


def loaded_by_mlx(path):
    arrays = mx.load(str(path))
    mx.eval(list(arrays.values()))
    return arrays, None


def restore_with_mlx_load(files: list, expected: list[dict]) -> list:
    pairs = zip(files, expected, strict=True)
    chunks = [read_file(path, want, load=loaded_by_mlx)[0] for path, want in pairs]
    layers = []
    for name in chunks[0]:
        pieces = [chunk[name] for chunk in chunks]  # (layers, 1, heads, tokens, width)
        tokens = sum(p.shape[3] for p in pieces)
        first = pieces[0]
        room = (tokens // STEP + 1) * STEP - tokens
        pad = mx.zeros((*first.shape[:3], room, first.shape[4]), first.dtype)
        joined = mx.concatenate([*pieces, pad], axis=3)
        layers += [joined[i] for i in range(first.shape[0])]
    mx.eval(layers)
    return layers


def main() -> None:
    loaded = loading.load(sys.argv[1])
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 15
    entry, files, store = saved_chat(loaded, tokens)
    layers = len(loaded.cache_layer_shapes)
    expected = [
        ChunkManifest(
            store.fingerprint,
            entry.kv_format,
            key,
            start,
            end,
            tokens_hash(entry.tokens[start:end]),
            layers,
        ).expected()
        for key, start, end in store.saved_chunks(entry)
    ]
    reads, restores, others = [], [], []
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
        gc.collect()
        started = time.perf_counter()
        other = restore_with_mlx_load(files, expected)
        others.append(time.perf_counter() - started)
        del other
    read, restore, other = (statistics.median(x) for x in (reads, restores, others))
    print(f"{len(entry.tokens)} tokens, {len(files)} files, {rounds} rounds (medians)")
    print(f"plain read          {read * 1e3:7.2f} ms")
    print(f"the app's restore   {restore * 1e3:7.2f} ms ({restore / read:.1f}x)")
    print(f"mx.load + a join    {other * 1e3:7.2f} ms ({other / read:.1f}x)")


if __name__ == "__main__":
    main()
