"""CPU probe behind the README's short-follow-up figures (issue 14): the starter model
after 1k and 4k tokens, a 17-token prompt (a reopened chat's next message) in one
call with the numpy layers (`cpu_layers`) and with mlx's, each giving the last row's
logits only as a turn does (`last_row`), and the numpy layers giving every row's,
alternated seven times on two OpenBLAS threads; the median of each. Run from the
project root with an imported model:

    .venv/bin/python docs/probes/short_turn_probe.py MODEL_DIR
"""

import statistics
import sys
import time

from app.engine import cpu_blas, cpu_layers, last_row  # app.engine loads OpenBLAS first
from app.engine.loading import load


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = load(sys.argv[1]).model
    last_row.install(model)
    ids = mx.random.randint(100, 20000, (5000,), key=mx.random.key(1))
    cpu_blas.set_threads(2)
    for context in (1024, 4096):
        cache = make_prompt_cache(model)
        for start in range(0, context, 512):
            model(ids[None, start : min(context, start + 512)], cache=cache)
            mx.eval([layer.state for layer in cache])
        taken = {"numpy layers": [], "mlx layers": [], "numpy layers, every row's logits": []}
        for _ in range(7):
            for label in taken:
                cpu_layers.enabled = label != "mlx layers"
                started = time.perf_counter()
                if label.endswith("logits"):
                    mx.eval(model(ids[None, context : context + 17], cache=cache)[:, -1])
                else:
                    with last_row.only_last_row(model):
                        mx.eval(model(ids[None, context : context + 17], cache=cache)[:, -1])
                taken[label].append(time.perf_counter() - started)
                for layer in cache:
                    layer.trim(17)
        medians = ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in taken.items())
        print(f"{context} tokens, 17-token call: {medians}")


if __name__ == "__main__":
    main()
