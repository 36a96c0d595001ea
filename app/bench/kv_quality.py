"""`reprise bench kv`: what each way of storing the KV cache costs in quality,
memory and speed, side by side in one run.

For every mode the model reads the same held-out text the way a chat does:
the context is prefilled in steps, then the continuation is fed one token at
a time, so its own keys and values go through the mode's cache exactly as
generated tokens do. Measured per mode:

- perplexity of the continuation, and the mean KL divergence of each next-token
  distribution from the 16-bit row's (the 16-bit row is the cache the app keeps
  with quantization Off: float16 where the model computes in float32, so byte
  shares are against true 16 bits, as the Memory preference shows them);
- KV bytes at the end of the text, and peak mlx memory (weights included);
- prefill and decode tokens/s;
- a loop check: 256 greedy tokens after the whole text, and the share of their
  4-grams that repeat an earlier one.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from itertools import islice

import mlx.core as mx
import numpy as np
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import make_prompt_cache

from app.engine import steps
from app.engine.generation import SamplingSettings
from app.engine.kvconvert import quantizer
from app.engine.kvscheme import APP_SCHEMES, KVScheme
from app.resource_files import resource

TEXT = resource("text/held-out-essays.txt")
GREEDY = SamplingSettings.greedy()
LOOP_TOKENS = 256


@dataclass(frozen=True)
class Mode:
    name: str
    scheme: KVScheme | None = None  # ours
    mlx_lm_bits: int | None = None  # mlx-lm's QuantizedKVCache
    group_size: int = 64

    def make_cache(self, model) -> tuple[list, Callable[[list], None]]:
        """A fresh cache and what to run on it after each forward pass."""
        cache = make_prompt_cache(model)
        if self.scheme is not None:
            quantizer(self.scheme)(cache)
            return cache, lambda c: None
        return cache, partial(
            maybe_quantize_kv_cache,
            quantized_kv_start=0,
            kv_group_size=self.group_size,
            kv_bits=self.mlx_lm_bits,
        )


def default_modes(group_size: int = 64, off: KVScheme | None = None) -> list[Mode]:
    """The rows, the reference first: what the app runs with quantization Off (`off`,
    `ChatSession.kv_scheme`: float16 on the CPU path, whose model computes in float32;
    None, mlx-lm's own KVCache in the model's type, elsewhere)."""
    g = group_size
    return [
        Mode("16-bit", off),
        Mode("mlx-lm 8-bit", mlx_lm_bits=8, group_size=g),
        Mode("mlx-lm 4-bit", mlx_lm_bits=4, group_size=g),
        Mode("k8v8 sink+window", KVScheme(8, 8, g, sink=4, window=64)),
        Mode("k8v4", KVScheme(8, 4, g)),
        Mode("k4v4 sink+window", KVScheme(4, 4, g, sink=4, window=64)),
        Mode("k4v4 hadamard sink+window", KVScheme(4, 4, g, sink=4, window=64, rotate_keys=True)),
        Mode("k4v4 hadamard sink+window128", KVScheme(4, 4, g, 4, 128, rotate_keys=True)),
        Mode("k4v3 hadamard sink+window128", KVScheme(4, 3, g, 4, 128, rotate_keys=True)),
        Mode("k3v3 hadamard sink+window", KVScheme(3, 3, g, sink=4, window=64, rotate_keys=True)),
    ]


@dataclass
class Row:
    mode: str
    ppl: float
    kl: float
    kv_bytes: int
    peak_bytes: int
    repeat_4gram: float
    prefill_tps: float
    decode_tps: float


def repeated_4gram_share(tokens: list[int]) -> float:
    """Share of 4-grams that already occurred earlier in `tokens`."""
    seen, repeats, grams = set(), 0, 0
    for i in range(len(tokens) - 3):
        gram = tuple(tokens[i : i + 4])
        repeats += gram in seen
        grams += 1
        seen.add(gram)
    return repeats / grams if grams else 0.0


def _log_probs(model, cache: list, after: Callable, token_ids: list[int]) -> mx.array:
    logits = model(mx.array(token_ids)[None], cache=cache)[0, -1].astype(mx.float32)
    after(cache)
    return logits - mx.logsumexp(logits)


def measure(
    model, mode: Mode, context: list[int], continuation: list[int], reference: list | None
) -> tuple[Row, list[np.ndarray]]:
    """One mode's row, and its log-probabilities (the reference for later rows)."""
    mx.clear_cache()
    mx.reset_peak_memory()
    cache, after = mode.make_cache(model)
    started = time.perf_counter()
    for _ in steps.prefill(model, cache, context[:-1], after):  # the app's own prefill
        pass
    prefill_s = time.perf_counter() - started

    fed = [context[-1], *continuation[:-1]]
    nll, kl, log_probs, decode_s = 0.0, 0.0, [], 0.0
    for i, (token, target) in enumerate(zip(fed, continuation, strict=True)):
        # Only the step is timed: the KL below (mlx's scalar exp over the vocabulary,
        # 0.5 ms here) is bookkeeping of the rows after the first, not decoding.
        started = time.perf_counter()
        lp = _log_probs(model, cache, after, [token])
        mx.eval(lp)
        decode_s += time.perf_counter() - started
        nll -= lp[target].item()
        if reference is None:
            log_probs.append(np.array(lp))
        else:
            ref = mx.array(reference[i])
            kl += mx.sum(mx.exp(ref) * (ref - lp)).item()
    kv_bytes = sum(layer.nbytes for layer in cache)

    # The loop check decodes as the app does: its own decode step, greedy.
    generated: list[int] = []
    next_token = steps.make_next_token(model, cache, GREEDY, after, generated)
    for token in islice(steps.decode(next_token, continuation[-1:]), LOOP_TOKENS):
        generated.append(token)
    row = Row(
        mode=mode.name,
        ppl=float(np.exp(nll / len(continuation))),
        kl=kl / len(continuation) if reference is not None else 0.0,
        kv_bytes=kv_bytes,
        peak_bytes=mx.get_peak_memory(),
        repeat_4gram=repeated_4gram_share(generated),
        prefill_tps=(len(context) - 1) / prefill_s,
        decode_tps=len(fed) / decode_s,
    )
    return row, log_probs


def run(model, tokens: list[int], modes: list[Mode], continuation_tokens: int) -> list[Row]:
    context, continuation = tokens[:-continuation_tokens], tokens[-continuation_tokens:]
    # Warm up kernels and memory so the first row is not charged for it.
    measure(model, Mode("warm-up"), context[:64], continuation[:8], None)
    rows, reference = [], None
    for n, mode in enumerate(modes, 1):
        print(f"[{n}/{len(modes)}] {mode.name} {time.strftime('%X')}", file=sys.stderr, flush=True)
        try:
            row, log_probs = measure(model, mode, context, continuation, reference)
        except RuntimeError as exc:  # mlx-lm's quantized attention has no CUDA kernel
            print(f"  {mode.name} fails here: {str(exc).splitlines()[0]}", file=sys.stderr)
            continue
        reference = reference or log_probs
        rows.append(row)
    return rows


def as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(row) for row in rows]


def off_scheme(loaded) -> KVScheme | None:
    """How the app keeps this model's cache with quantization Off."""
    from app.engine.chat import ChatSession
    from app.engine.generation import KVSettings

    return ChatSession(loaded).kv_scheme(KVSettings())


def app_modes(rows: list[Row]) -> dict[str, str]:
    """The rows the Memory preference's 8-bit and 4-bit use."""
    names = {mode.scheme: mode.name for mode in default_modes() if mode.scheme is not None}
    present = {row.mode for row in rows}
    return {
        label: names[scheme]
        for label, scheme in APP_SCHEMES.items()
        if names.get(scheme) in present
    }


def main(args: argparse.Namespace) -> int:
    from app.engine import loading, models
    from sessions import paths

    loaded = loading.load(models.resolve(args.model, paths.models_dir()))
    tokens = loaded.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    if len(tokens) < args.tokens:
        raise SystemExit(f"the text has {len(tokens)} tokens, fewer than --tokens {args.tokens}")
    modes = default_modes(args.group_size, off_scheme(loaded))
    if args.modes:
        modes = [m for m in modes if m.name == "16-bit" or m.name in args.modes]
    rows = run(loaded.model, tokens[: args.tokens], modes, args.continuation)
    result = {
        "rows": as_dicts(rows),
        "app_modes": app_modes(rows),
        "model": loaded.path.name,
        "compute": loaded.compute.describe(),
        "tokens": args.tokens,
        "continuation": args.continuation,
    }
    if args.save:
        args.save.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"model: {loaded.path.name} ({loaded.compute.describe()}); {args.tokens} tokens of "
        f"{TEXT.name}, the last {args.continuation} fed one at a time; loop check "
        f"{LOOP_TOKENS} greedy tokens"
    )
    print(format_table(rows, result["app_modes"]))
    return 0


def format_table(rows: list[Row], chosen: dict[str, str]) -> str:
    base = rows[0]
    marks = {name: label for label, name in chosen.items()}
    lines = [
        f"{'mode':40}{'ppl':>8}{'Δppl':>8}{'KL':>8}{'KV bytes':>10}{'peak':>8}"
        f"{'4-gram rep':>11}{'prefill/s':>10}{'decode/s':>9}",
    ]
    for row in rows:
        name = row.mode + (f" [app {marks[row.mode]}]" if row.mode in marks else "")
        kv_share, peak_share = row.kv_bytes / base.kv_bytes, row.peak_bytes / base.peak_bytes
        lines.append(
            f"{name:40}{row.ppl:8.3f}{(row.ppl / base.ppl - 1) * 100:+7.2f}%{row.kl:8.4f}"
            f"{kv_share * 100:9.1f}%{peak_share * 100:7.1f}%"
            f"{row.repeat_4gram:11.3f}{row.prefill_tps:10.1f}{row.decode_tps:9.2f}"
        )
    lines.append(
        f"(16-bit: {base.kv_bytes / 1e6:.1f} MB of KV, {base.peak_bytes / 1e6:.0f} MB peak; "
        "shares are of the 16-bit row)"
    )
    return "\n".join(lines)
