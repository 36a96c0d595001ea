"""CPU probe behind the README's codes-path figure for a bigger model (6 December):
a Qwen3-1.7B shape with random 4-bit weights (`app/bench/shapes.py`, the starter's
tokenizer), loaded on the codes path and as stored, each answering a 64-token prompt
with 12 greedy tokens; its weights' bytes, time to first token and decode speed. The
stored path takes about ten minutes here. Run from the project root:

    .venv/bin/python docs/probes/codes_path_shape_probe.py STARTER_DIR [OUT_DIR]
"""

import sys
import tempfile
from pathlib import Path

import app.engine  # noqa: F401  (OpenBLAS before mlx)
from app.bench import shapes
from app.bench.compute_paths import weight_bytes
from app.engine import loading
from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings, TurnFinished


def main() -> None:
    out = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp())
    folder = shapes.model_folder("qwen3-1.7b", Path(sys.argv[1]), out)
    for compute in ("codes", "stored"):
        loaded = loading.load(folder, compute=compute)
        events = ChatSession(loaded).generate(
            list(range(1000, 1064)), sampling=SamplingSettings.greedy(12)
        )
        stats = [e for e in events if isinstance(e, TurnFinished)][-1].stats
        print(
            f"{compute}: weights {weight_bytes(loaded) / 1e9:.2f} GB, 64-token prompt's first "
            f"token {stats.ttft_s:.2f} s, decode {stats.decode_tps:.2f} tok/s"
        )
    print(f"float32 weights would take {4 * loading._parameter_count(loaded.model) / 1e9:.1f} GB")


if __name__ == "__main__":
    main()
