"""`reprise bench kv-decode`: decode speed of the app's 8-bit and 4-bit KV caches
against 16-bit on one model, their steps interleaved.

Why a second speed bench: `bench kv` measures each mode in turn, a minute or
more apart, so on a machine shared with other work a change of load between
rows lands in the ratios (four runs of it here, one build, gave 8-bit 0.84x to
1.05x). Here every mode is prefilled with the same context, then each decodes
the same token in turn (the order reversed every step), so the load of a moment
falls on all of them alike; the median step time per mode is reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, replace

import mlx.core as mx

from app.bench.kv_quality import TEXT, Mode, default_modes, off_scheme
from app.engine import kvnative, steps
from app.engine.kvscheme import APP_SCHEMES, KVScheme


def app_modes(group_size: int = 64, off: KVScheme | None = None) -> list[Mode]:
    """16-bit first (the app's Off, `off`), then the modes the Memory preference's
    8-bit and 4-bit use."""
    schemes = {replace(scheme, group_size=group_size) for scheme in APP_SCHEMES.values()}
    modes = default_modes(group_size, off)
    return [modes[0], *(mode for mode in modes if mode.scheme in schemes)]


@dataclass(frozen=True)
class NumpyProducts(Mode):
    """A mode whose steps run with the compiled products off (kvnative), so that the
    numpy fallback is timed beside them, on the same load."""


def decode_step(mode: Mode, model, token: mx.array, cache: list) -> None:
    held = kvnative.enabled
    kvnative.enabled = held and not isinstance(mode, NumpyProducts)
    try:
        mx.eval(model(token, cache=cache))
    finally:
        kvnative.enabled = held


def with_numpy_rows(modes: list[Mode]) -> list[Mode]:
    """`modes`, plus each quantized one again on the numpy products where the library
    is built (their rows say "numpy")."""
    if not kvnative.available():
        return modes
    quantized = [m for m in modes if m.scheme is not None and m.scheme.key_bits is not None]
    again = [NumpyProducts(f"{m.name} (numpy)", m.scheme) for m in quantized]
    return [*modes, *again]


def step_times(model, tokens: list[int], modes: list[Mode], context: int, count: int) -> list:
    """Per mode, the seconds of each of `count` decode steps after `context` tokens."""
    caches = []
    for mode in modes:
        cache, after = mode.make_cache(model)
        for _ in steps.prefill(model, cache, tokens[:context], after):
            pass
        caches.append((cache, after))
    times: list[list[float]] = [[] for _ in modes]
    for i in range(count):
        token = mx.array([[tokens[context + i]]])
        order = range(len(modes)) if i % 2 == 0 else reversed(range(len(modes)))
        for n in order:
            cache, after = caches[n]
            started = time.perf_counter()
            decode_step(modes[n], model, token, cache)
            after(cache)
            times[n].append(time.perf_counter() - started)
    return times


def rows(modes: list[Mode], times: list[list[float]]) -> list[dict]:
    base = statistics.median(times[0])
    return [
        {
            "mode": mode.name,
            "step_ms": statistics.median(seconds) * 1e3,
            "decode_tps": 1 / statistics.median(seconds),
            "vs_16_bit": base / statistics.median(seconds),
        }
        for mode, seconds in zip(modes, times, strict=True)
    ]


def main(args: argparse.Namespace) -> int:
    from app.engine import loading, models
    from sessions import paths

    loaded = loading.load(models.resolve(args.model, paths.models_dir()))
    tokens = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if len(tokens) < args.tokens + args.steps:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than --tokens + --steps")
    modes = with_numpy_rows(app_modes(args.group_size, off_scheme(loaded)))
    times = step_times(loaded.model, tokens, modes, args.tokens, args.steps)
    result = {
        "rows": rows(modes, times),
        "model": loaded.path.name,
        "compute": loaded.compute.describe(),
        "context": args.tokens,
        "steps": args.steps,
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"model: {loaded.path.name} ({loaded.compute.describe()}); {args.tokens} tokens of "
        f"context, {args.steps} decode steps per mode, interleaved; median step"
    )
    for row in result["rows"]:
        print(
            f"{row['mode']:32}{row['step_ms']:8.2f} ms{row['decode_tps']:8.2f}/s"
            f"{row['vs_16_bit']:7.3f}x"
        )
    return 0
