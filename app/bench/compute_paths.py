"""`reprise bench weights`: one quantized model on the CPU paths `loading` offers.

- dense: float32 weights, dequantized at load (the codes kept beside them for
  decode steps where this CPU runs their fast build): what a model that fits gets;
- codes: float32 compute, the known layers' projections kept as codes (widened one
  at a time for a product of many rows): what a model too big for float32 gets;
- stored: the weights as stored, mlx's own quantized kernels: what it got before,
  and still gets where the codes path does not fit either.

For each path: the bytes its weights hold, and for each context length the prefill
and decode speed of a fresh chat and the time to first token of a 17-token
follow-up in it. Paths alternate (in order, then reversed) and each keeps its faster
run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from mlx.utils import tree_flatten

from app.bench import shapes
from app.bench.cpu_path import prompt_tokens
from app.engine import loading, models
from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings, TurnFinished
from sessions import paths

PATHS = ("dense", "codes", "stored")
DECODE_TOKENS = 32
FOLLOW_UP = 17


def weight_bytes(loaded: loading.LoadedModel) -> int:
    """The model's parameters, and the codes' scales a dense layer keeps beside them."""
    total = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    for _, module in loaded.model.named_modules():
        packed = module.__dict__.get("packed_weight")
        if packed is not None and "scales" not in module:  # a dense layer's own copy
            total += packed.codes.nbytes + packed.scales.nbytes + packed.biases.nbytes
    return total


def _finished(events) -> TurnFinished:
    return [e for e in events if isinstance(e, TurnFinished)][-1]


def measure(loaded: loading.LoadedModel, prompt: list[int], follow_up: list[int]) -> dict:
    session = ChatSession(loaded)
    greedy = SamplingSettings.greedy(DECODE_TOKENS)
    first = _finished(session.generate(prompt, sampling=greedy)).stats
    again = _finished(
        session.generate(list(session.tokens) + follow_up, sampling=SamplingSettings.greedy(1))
    ).stats
    return {
        "prefill_tps": first.prefill_tps,
        "decode_tps": first.decode_tps,
        "follow_up_ttft_s": again.ttft_s,
    }


def run(model: str | None, contexts, chosen=PATHS, report=print, shape: str | None = None) -> dict:
    """`shape`: a real shape with random 4-bit weights (`bench.shapes`, the model lending
    its tokenizer) in place of the model, written to a temporary folder."""
    model_dir = models.resolve(model, paths.models_dir())
    with tempfile.TemporaryDirectory() as scratch:
        if shape:
            model_dir = shapes.model_folder(shape, model_dir, Path(scratch))
        loaded = {name: loading.load(model_dir, compute=name) for name in chosen}
    return _measure_all(model_dir.name, loaded, contexts, report)


def _measure_all(model_name: str, loaded: dict, contexts, report) -> dict:
    result: dict = {"model": model_name, "paths": {}}
    for name, one in loaded.items():
        described = {"compute": one.compute.describe(), "weight_bytes": weight_bytes(one)}
        result["paths"][name] = described
        report(f"{name}: {described['compute']}, weights {described['weight_bytes'] / 1e6:.0f} MB")
    tokenizer = next(iter(loaded.values())).tokenizer
    result["contexts"] = []
    for context in contexts:
        prompt = prompt_tokens(tokenizer, context + FOLLOW_UP)
        runs: dict[str, list[dict]] = {name: [] for name in loaded}
        for order in (list(loaded), list(loaded)[::-1]):
            for name in order:
                runs[name].append(measure(loaded[name], prompt[:context], prompt[context:]))
        row = {"context": context}
        for name, measured in runs.items():
            row[name] = {
                "prefill_tps": max(r["prefill_tps"] for r in measured),
                "decode_tps": max(r["decode_tps"] for r in measured),
                "follow_up_ttft_s": min(r["follow_up_ttft_s"] for r in measured),
            }
        result["contexts"].append(row)
        report(row_text(row))
    return result


def row_text(row: dict) -> str:
    parts = [f"{row['context']:>6} tokens"]
    for name in PATHS:
        if name in row:
            r = row[name]
            parts.append(
                f"{name}: prefill {r['prefill_tps']:.1f}, decode {r['decode_tps']:.1f} tok/s, "
                f"follow-up TTFT {r['follow_up_ttft_s']:.3f} s"
            )
    return "   ".join(parts)


def main(args: argparse.Namespace) -> int:
    def report(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    result = run(args.model, args.context, args.paths, report, args.shape)
    if args.json:
        print(json.dumps(result, indent=2))
    return 0
