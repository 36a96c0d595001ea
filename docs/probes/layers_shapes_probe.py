"""CPU probe behind the README's figures for the numpy layers on other families than
the starter's (issue 14): a real shape with random weights (`bench reopen --shape`'s,
written with the starter model's tokenizer), loaded as the app loads a model (float32,
`cpu_layers` installed), `context` tokens prefilled, then eight decode steps with the numpy
layers and eight with mlx's, alternated five times on two OpenBLAS threads (the cache
goes on growing: a sliding window's ring cannot be cut back); the median step.
Run from the project root with an imported starter model:

    .venv/bin/python docs/probes/layers_shapes_probe.py STARTER_DIR gemma3-1b 1024
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

from app.engine import cpu_blas, cpu_layers  # app.engine loads OpenBLAS before mlx
from app.engine.loading import load


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from app.bench import shapes

    tokenizer_dir, shape, context = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    with tempfile.TemporaryDirectory() as scratch:
        loaded = load(shapes.model_folder(shape, tokenizer_dir, Path(scratch)))
    model = loaded.model
    installed = sum(type(m).__mro__[1] in cpu_layers.LAYOUTS for _, m in model.named_modules())
    print(f"{shape}: {loaded.compute.describe()}; {installed} blocks take the numpy layers")
    ids = mx.random.randint(100, 20000, (context + 80,), key=mx.random.key(1))
    cache = make_prompt_cache(model)
    for start in range(0, context, 512):
        model(ids[None, start : min(context, start + 512)], cache=cache)
        mx.eval([layer.state for layer in cache])
    cpu_blas.set_threads(2)
    taken = {"numpy layers": [], "mlx layers": []}
    position = context
    for _ in range(5):
        for label in taken:
            cpu_layers.enabled = label == "numpy layers"
            started = time.perf_counter()
            for _ in range(8):
                mx.eval(model(ids[None, position : position + 1], cache=cache))
                position += 1
            taken[label].append((time.perf_counter() - started) / 8)
    steps = ", ".join(f"{k} {statistics.median(v) * 1e3:.1f} ms" for k, v in taken.items())
    print(f"{shape}, {context} tokens, a decode step: {steps}")


if __name__ == "__main__":
    main()
