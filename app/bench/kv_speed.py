"""`reprise bench kv-speed`: decode speed of each KV scheme against 16-bit at long
contexts, on a model of a known shape with random weights (nothing to download),
on whatever device mlx runs on. This is the GPU check of issue 5: mlx's CUDA
backend has no `quantized_matmul` kernel for the decode shapes that mlx-lm's
quantized attention needs, while our schemes read the cache back dequantized.

Needs only mlx, mlx-lm and the engine, so it runs on a machine with nothing else
installed: `python -m app.cli bench kv-speed --json`.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from app.bench.shapes import SHAPES, config_of, random_model
from app.engine.kvconvert import to_mixed
from app.engine.kvscheme import APP_SCHEMES, KVScheme

PREFILL_STEP = 2048


def modes(group_size: int) -> dict[str, Callable[[KVCache], object]]:
    """Name -> how to turn a filled 16-bit layer into that mode's layer."""

    def ours(scheme: KVScheme):
        return lambda layer: to_mixed(layer, scheme)

    result = {"16-bit": lambda layer: layer}
    for bits in (8, 4):
        result[f"mlx-lm {bits}-bit"] = lambda layer, b=bits: layer.to_quantized(group_size, b)
    for label, scheme in APP_SCHEMES.items():
        result[f"app {label} ({scheme.format})"] = ours(scheme)
    result["k8v4"] = ours(KVScheme(8, 4, group_size))
    return result


def fill(model, tokens: int, vocab: int) -> list[KVCache]:
    cache = make_prompt_cache(model)
    ids = mx.random.randint(0, vocab, (tokens,), key=mx.random.key(0))
    for start in range(0, tokens, PREFILL_STEP):
        model(ids[start : start + PREFILL_STEP][None], cache=cache)
        mx.eval([layer.state for layer in cache])
    return cache


def decode_tps(model, cache: list, steps: int, warmup: int = 4) -> float:
    """Greedy decoding pipelined as the chat engine does it: the next step's graph is
    built while the device computes this one."""

    def step(token: mx.array) -> mx.array:
        return mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1, keepdims=True)

    token = step(mx.array([[1]]))
    mx.async_eval(token)
    for i in range(warmup + steps):
        if i == warmup:
            mx.eval(token)
            started = time.perf_counter()
        following = step(token)
        mx.async_eval(following)
        token = following
    mx.eval(token)
    return steps / (time.perf_counter() - started)


def attention_us(cache: list, heads: int, reps: int = 50) -> float:
    """One decode step's attention alone, every layer, in microseconds (median of 7
    timings of `reps` steps): the model's weights and its graph building left out,
    which on a GPU are most of a small model's step and swing from run to run."""
    import statistics

    layer = cache[0]
    dim = (
        layer.state[0].shape[-1]
        if isinstance(layer, KVCache)
        else layer.exact[0].buffers[0].shape[-1]
    )
    q = mx.random.normal((1, heads, 1, dim), key=mx.random.key(3)).astype(mx.bfloat16)
    if isinstance(layer, KVCache):
        reads = [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]

        def step():
            return [
                mx.fast.scaled_dot_product_attention(q, k, v, scale=dim**-0.5) for k, v in reads
            ]
    else:

        def step():
            return [c.attend(q, dim**-0.5, None) for c in cache]

    for _ in range(5):
        mx.eval(step())
    timings = []
    for _ in range(7):
        mx.synchronize()
        started = time.perf_counter()
        for _ in range(reps):
            mx.eval(step())
        mx.synchronize()
        timings.append((time.perf_counter() - started) / reps)
    return statistics.median(timings) * 1e6


def run(
    shape: str, lengths: list[int], steps: int, group_size: int = 64, attention: bool = False
) -> dict:
    model = random_model(shape)
    vocab = SHAPES[shape]["vocab_size"]
    results = []
    for length in lengths:
        for name, convert in modes(group_size).items():
            row = {"mode": name, "context": length}
            try:
                # Each mode fills its own cache, so only that cache is in memory when
                # peak memory is measured.
                cache = [convert(layer) for layer in fill(model, length, vocab)]
                mx.eval([layer.state for layer in cache])
                row["kv_bytes"] = sum(layer.nbytes for layer in cache)  # before decode adds slack
                mx.clear_cache()
                mx.reset_peak_memory()
                row["decode_tps"] = decode_tps(model, cache, steps)
                row["peak_bytes"] = mx.get_peak_memory()
                if attention and not name.startswith("mlx-lm"):
                    heads = SHAPES[shape]["num_attention_heads"]
                    row["attention_us"] = attention_us(cache, heads)
            except (RuntimeError, ValueError) as exc:
                row["error"] = str(exc).splitlines()[0][:160]
            results.append(row)
            cache = None
    for row in results:
        base = next(r for r in results if r["context"] == row["context"] and r["mode"] == "16-bit")
        if "decode_tps" in row:
            row["speed_vs_16bit"] = row["decode_tps"] / base["decode_tps"]
            row["kv_share"] = row["kv_bytes"] / base["kv_bytes"]
            row["peak_vs_16bit"] = row["peak_bytes"] / base["peak_bytes"]
        if "attention_us" in row and "attention_us" in base:
            row["attention_vs_16bit"] = base["attention_us"] / row["attention_us"]
    return {"shape": shape, "device": str(mx.default_device()), "rows": results}


def format_table(result: dict) -> str:
    lines = [
        f"{result['shape']} (random 4-bit weights, bfloat16) on {result['device']}",
        f"{'mode':36}{'context':>8}{'decode/s':>10}{'vs 16-bit':>10}{'KV bytes':>10}{'peak GB':>9}",
    ]
    for row in result["rows"]:
        if "error" in row:
            lines.append(f"{row['mode']:36}{row['context']:8}  fails: {row['error']}")
            continue
        lines.append(
            f"{row['mode']:36}{row['context']:8}{row['decode_tps']:10.1f}"
            f"{row['speed_vs_16bit']:10.2f}{row['kv_share'] * 100:9.1f}%"
            f"{row['peak_bytes'] / 1e9:9.2f}"
            + (
                f"   attention {row['attention_us']:7.0f} us/step"
                f" ({row.get('attention_vs_16bit', 1.0):.2f}x)"
                if "attention_us" in row
                else ""
            )
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    config_of(args.shape)  # an unknown shape: a clear error before any work
    result = run(args.shape, args.tokens, args.steps, attention=args.attention)
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0
