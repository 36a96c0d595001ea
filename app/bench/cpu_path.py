"""`reprise bench cpu`: the engine's compute path against plain mlx-lm.

Both run the same model folder on the same prompt tokens, in one invocation:
plain mlx-lm (`mlx_lm.load` + `stream_generate`) in a child process that has
nothing of Reprise in it, then the engine in this process. Figures are tokens
per second, and the ratio engine / plain.

`--context N ...` adds long prompts: the engine's prefill of N tokens and its
decode after them, as it runs, then with float32 weights in its one-row products
(the `packed_rows` switch; a quantized model's decode reads its codes), then with
mlx's layers in decode steps too (`cpu_layers`), then with mlx's matmul for
one-row products as well (`cpu_blas`), then with mlx's attention too
(`cpu_attention`), and with
`--peer llama.cpp` llama.cpp's prefill and decode on the same GGUF and tokens.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from app.bench import llama_cpp_peer
from app.engine import cpu_attention, cpu_blas, cpu_layers, loading, models, packed_rows
from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings, TurnFinished
from app.resource_files import resource
from sessions import paths

TEXT = resource("text/ordinary-english.txt")
DECODE_TOKENS = 32
# (row name, the switches on: packed_rows, cpu_layers, cpu_blas, cpu_attention)
SWITCHES = (packed_rows, cpu_layers, cpu_blas, cpu_attention)
VARIANTS = (
    ("engine", (True, True, True, True)),
    ("engine_float32_products", (False, True, True, True)),
    ("engine_mlx_layers", (False, False, True, True)),
    ("engine_mlx_products", (False, False, False, True)),
    ("engine_mlx_attention", (False, False, False, False)),
)


def prompt_tokens(tokenizer, count: int) -> list[int]:
    """`count` tokens of ordinary English, repeating the text if needed."""
    ids = tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
    while len(ids) < count:
        ids = ids + ids
    return ids[:count]


def measure_plain(model_dir: Path, prompt: list[int]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompt, f)
    script = Path(__file__).with_name("plain_mlx_lm.py")
    done = subprocess.run(
        [sys.executable, str(script), str(model_dir), f.name, str(DECODE_TOKENS)],
        capture_output=True,
        text=True,
        check=False,
    )
    Path(f.name).unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"plain mlx-lm run failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_engine(loaded: loading.LoadedModel, prompt: list[int]) -> dict:
    session = ChatSession(loaded)
    list(session.generate(prompt[:16], sampling=SamplingSettings.greedy(2)))  # warm-up
    session.reset()
    finished = None
    for event in session.generate(prompt, sampling=SamplingSettings.greedy(DECODE_TOKENS)):
        if isinstance(event, TurnFinished):
            finished = event
    stats = finished.stats
    return {
        "prefill_tps": stats.prefill_tps,
        "decode_tps": stats.decode_tps,
        "prompt_tokens": stats.prefilled_tokens,
        "generated_tokens": stats.generated_tokens,
    }


def measure_context(loaded: loading.LoadedModel, prompt: list[int], gguf: Path | None) -> dict:
    """One long prompt: the engine as it runs, then with each of its CPU-path parts
    turned off in turn (`VARIANTS`), then llama.cpp. The variants run twice, in
    order and then in reverse, and each keeps its faster run (llama.cpp too): the
    first run at a new length paid for its warm-up (a 4k decode 19.8 tok/s, 37.9
    when alternated)."""
    row: dict = {"context": len(prompt)}
    runs: dict[str, list[dict]] = {name: [] for name, _ in VARIANTS}
    for order in (VARIANTS, VARIANTS[::-1]):
        for name, switches_on in order:
            runs[name].append(_measure_with(loaded, prompt, switches_on))
    for name, measured in runs.items():
        row[name] = max(measured, key=lambda r: r["decode_tps"])
    if gguf is not None:
        peer = [llama_cpp_peer.speed(gguf, prompt, DECODE_TOKENS) for _ in range(2)]
        row["llama_cpp"] = max(peer, key=lambda r: r["decode_tps"])
        row["decode_vs_llama_cpp"] = row["engine"]["decode_tps"] / row["llama_cpp"]["decode_tps"]
    return row


def _measure_with(loaded: loading.LoadedModel, prompt: list[int], switches_on) -> dict:
    was = [module.enabled for module in SWITCHES]
    for module, on in zip(SWITCHES, switches_on, strict=True):
        module.enabled = on and module.enabled  # a part the user turned off stays off
    try:
        return measure_engine(loaded, prompt)
    finally:
        for module, on in zip(SWITCHES, was, strict=True):
            module.enabled = on


def run(model: str | None, count: int, contexts=(), gguf: Path | None = None, report=print) -> dict:
    model_dir = models.resolve(model, paths.models_dir())
    loaded = loading.load(model_dir)
    prompt = prompt_tokens(loaded.tokenizer, count)
    plain = measure_plain(model_dir, prompt)
    engine = measure_engine(loaded, prompt)
    long_rows = []
    for context in contexts:
        long_rows.append(measure_context(loaded, prompt_tokens(loaded.tokenizer, context), gguf))
        report(context_text(long_rows[-1]))  # each length as soon as it is measured
    return {
        "model": model_dir.name,
        "compute": loaded.compute.describe(),
        "plain_mlx_lm": plain,
        "engine": engine,
        "prefill_ratio": engine["prefill_tps"] / plain["prefill_tps"],
        "decode_ratio": engine["decode_tps"] / plain["decode_tps"],
        "contexts": long_rows,
    }


def context_text(row: dict) -> str:
    parts = [f"{row['context']:>7} tokens"]
    for name, label in (
        ("engine", "engine"),
        ("engine_float32_products", "float32 products"),
        ("engine_mlx_layers", "and mlx layers"),
        ("engine_mlx_products", "and mlx products"),
        ("engine_mlx_attention", "and mlx attention"),
        ("llama_cpp", "llama.cpp"),
    ):
        if name in row:
            r = row[name]
            parts.append(f"{label}: prefill {r['prefill_tps']:.1f}, decode {r['decode_tps']:.1f}")
    return "   ".join(parts) + " tok/s"


def main(args: argparse.Namespace) -> int:
    gguf = llama_cpp_peer.gguf_for(args.peer, args.peer_gguf)

    def report(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    result = run(args.model, args.prompt_tokens, args.context or (), gguf, report)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    plain, engine = result["plain_mlx_lm"], result["engine"]
    print(f"model: {result['model']}   engine path: {result['compute']}")
    print(f"{'':16}{'prefill tok/s':>15}{'decode tok/s':>15}")
    print(f"{'plain mlx-lm':16}{plain['prefill_tps']:15.1f}{plain['decode_tps']:15.1f}")
    print(f"{'reprise engine':16}{engine['prefill_tps']:15.1f}{engine['decode_tps']:15.1f}")
    print(f"{'ratio':16}{result['prefill_ratio']:14.1f}x{result['decode_ratio']:14.1f}x")
    print(f"({engine['prompt_tokens']} prompt tokens, up to {DECODE_TOKENS} generated)")
    return 0
