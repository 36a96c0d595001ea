"""CPU probe behind the README's per-layer figures for the packed-cache products
(issue 13): one layer's decode products at the starter model's shape (3 KV heads,
3 queries each, head size 64, group 64), the compiled ones (app/engine/kvnative.py)
against kvcpu's numpy fallback and the float32 16-bit path's BLAS products. Run from
the project root, after `make setup` has built the library:

    .venv/bin/python docs/probes/kv_native_probe.py 2048 4096

Each figure is the fastest of 300 calls, in µs, for all three KV heads. One layer's
rows (3 MB of float32 at 4k tokens) stay in the CPU's cache between calls, which
flatters the float32 path most: in a decode step each of the 30 layers' rows come
from memory.

Written for the per-head calls `kvnative.scores` and `kvnative.values`, which
`kvnative.attend` (a whole layer in one call) replaced: run it at commit 003a5de.
"""

import sys
import time

import numpy as np

from app.engine import cpu_blas, kvcpu, kvnative  # app.engine loads OpenBLAS before mlx

HEADS, QUERIES, DIM, GROUP = 3, 3, 64, 64


def fastest(call, runs: int = 300) -> float:
    call()
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1e6


class Store:
    def __init__(self, bits: int) -> None:
        self.bits = bits


def packed(bits: int, tokens: int) -> list[np.ndarray]:
    import mlx.core as mx  # after app.engine (above)

    x = mx.random.normal((1, HEADS, tokens, DIM)).astype(mx.float16)
    parts = mx.quantize(x, group_size=GROUP, bits=bits)
    mx.eval(parts)
    return [np.asarray(part).reshape(HEADS, tokens, -1) for part in parts]


def products(parts: list, bits: int, q, w, scores) -> dict:
    """The four calls timed for one width: scores and values, in C and in numpy."""
    rows, store = kvnative.Rows(bits, parts), Store(bits)
    out = np.zeros((HEADS, QUERIES, DIM), np.float32)

    def scores_c():
        for h in range(HEADS):
            kvnative.scores(rows, h, q[h], scores[h])

    def values_c():
        for h in range(HEADS):
            kvnative.values(rows, h, w[h], out[h])

    return {
        "scores, C": scores_c,
        "scores, numpy": lambda: kvcpu._bulk_scores(store, parts, q, scores),
        "values, C": values_c,
        "values, numpy": lambda: kvcpu._bulk_values(store, parts, w),
    }


def one_length(tokens: int) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((HEADS, QUERIES, DIM), np.float32)
    w = rng.random((HEADS, QUERIES, tokens), np.float32)
    scores = np.empty((HEADS, QUERIES, tokens), np.float32)
    for bits in (8, 4):
        figures = products(packed(bits, tokens), bits, q, w, scores)
        times = ", ".join(f"{name} {fastest(call):.0f}" for name, call in figures.items())
        print(f"{tokens} tokens, {bits}-bit: {times}")
    wide = rng.standard_normal((HEADS, tokens, DIM), np.float32)
    score = fastest(lambda: cpu_blas.stacked_matmul(q, wide.transpose(0, 2, 1), scores))
    value = fastest(lambda: cpu_blas.stacked_matmul(w, wide))
    print(f"{tokens} tokens, float32 16-bit path: scores {score:.0f}, values {value:.0f}")


if __name__ == "__main__":
    if not kvnative.available():
        raise SystemExit("the library is not built here (make setup, with a C compiler)")
    for length in sys.argv[1:] or ["2048", "4096"]:
        one_length(int(length))
