"""CPU probe behind the README's figures for the decode step's products through the
stored codes (`packed_rows`, issue 14): the starter model after CONTEXT tokens, decode
steps with float32 sgemv, with the codes on one thread and on two, and with the
attention's OpenBLAS on one thread or two, alternated in ten rounds of six steps; the
median step, and the time the step's products took. Run from
the project root with an imported model:

    .venv/bin/python docs/probes/packed_rows_probe.py MODEL_DIR [CONTEXT]
"""

import statistics
import sys
import time

from app.engine import cpu_blas, packed_rows  # app.engine loads OpenBLAS before mlx
from app.engine.loading import load

WAYS = {  # name: (packed_rows on, its threads, OpenBLAS's threads for the attention)
    "float32 sgemv": (False, 1, 2),
    "float32 sgemv, attention on 1 thread": (False, 1, 1),
    "codes, 1 thread": (True, 1, 2),
    "codes, 2 threads": (True, 2, 2),
    "codes, 2 threads, attention on 1": (True, 2, 1),
}


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = load(sys.argv[1]).model
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    ids = mx.random.randint(100, 20000, (context,), key=mx.random.key(1))
    cache = make_prompt_cache(model)
    for start in range(0, context, 512):
        model(ids[None, start : start + 512], cache=cache)
        mx.eval([layer.state for layer in cache])
    in_products = [0.0]
    timed = _timing(in_products)
    steps = {name: [] for name in WAYS}
    products = {name: [] for name in WAYS}
    token = mx.array([[5]])
    for _ in range(10):
        for name, (on, threads, blas_threads) in WAYS.items():
            packed_rows.enabled, timed.threads = on, threads
            cpu_blas.set_threads(blas_threads)
            for _ in range(2):  # settle
                mx.eval(model(token, cache=cache))
            in_products[0] = 0.0
            started = time.perf_counter()
            for _ in range(6):
                mx.eval(model(token, cache=cache))
            steps[name].append((time.perf_counter() - started) / 6)
            products[name].append(in_products[0] / 6)
            for layer in cache:
                layer.trim(8)
    for name in WAYS:
        step, product = statistics.median(steps[name]), statistics.median(products[name])
        print(f"{context} tokens, {name}: {step * 1e3:.1f} ms a step, products {product * 1e3:.1f}")


def _timing(total: list):
    """cpu_blas.row_product timed into total[0], on `threads` threads for the codes."""
    product = cpu_blas.row_product

    def timed(weight, row, packed=None):
        started = time.perf_counter()
        if packed_rows.usable(packed):
            out = packed_rows.product(packed, row, timed.threads)
        else:
            out = product(weight, row, None)
        total[0] += time.perf_counter() - started
        return out

    timed.threads = 1
    cpu_blas.row_product = timed
    return timed


if __name__ == "__main__":
    main()
