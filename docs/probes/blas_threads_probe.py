"""CPU probe behind the README's OpenBLAS-threads figures (issue 14): the starter
model after `context` tokens, one and two OpenBLAS threads alternated six times:
a decode token (median of 16 steps) and a turn of `turn` tokens in one call (the
reopened turn's shape). Run from the project root with an imported model:

    .venv/bin/python docs/probes/blas_threads_probe.py MODEL_DIR 1024 17
    (timeout 300 sh -c 'while :; do :; done' &); .venv/bin/python docs/probes/...
        the same beside a process that keeps one core busy
"""

import statistics
import sys
import time

from app.engine import cpu_blas  # app.engine loads OpenBLAS before mlx
from app.engine.loading import load


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    folder, context, turn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = load(folder).model
    ids = mx.random.randint(100, 20000, (context + 64,), key=mx.random.key(1))
    cache = make_prompt_cache(model)
    for start in range(0, context, 512):
        model(ids[None, start : min(context, start + 512)], cache=cache)
        mx.eval([layer.state for layer in cache])

    def fed(tokens: list) -> None:
        for chunk in tokens:
            mx.eval(model(chunk, cache=cache))
        for layer in cache:
            layer.trim(sum(chunk.shape[1] for chunk in tokens))

    steps = [ids[None, context + k : context + k + 1] for k in range(16)]
    shapes = {
        "decode token": (steps, 16),
        f"{turn}-token turn": ([ids[None, context:][:, :turn]], 1),
    }
    for label, (tokens, per) in shapes.items():
        times = {1: [], 2: []}
        for _ in range(6):
            for threads in times:
                cpu_blas.set_threads(threads)
                started = time.perf_counter()
                fed(tokens)
                times[threads].append((time.perf_counter() - started) / per)
        for threads, taken in times.items():
            print(
                f"{context} tokens, {label}, {threads} thread(s): "
                f"median {statistics.median(taken) * 1e3:.1f} ms, fastest {min(taken) * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
