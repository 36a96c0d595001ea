"""Baseline for `reprise bench cpu`: plain mlx-lm, as a user would run it.

Run as a script in its own process, so nothing of Reprise (in particular its
OpenBLAS preload) is in it. Prints one JSON object.
"""

import json
import sys

from mlx_lm import load, stream_generate


def measure(model_dir: str, prompt: list[int], max_tokens: int) -> dict:
    model, tokenizer = load(model_dir)
    for _ in stream_generate(model, tokenizer, prompt[:16], max_tokens=2):  # warm-up
        pass
    *_, last = stream_generate(model, tokenizer, prompt, max_tokens=max_tokens)
    return {
        "prefill_tps": last.prompt_tps,
        "decode_tps": last.generation_tps,
        "prompt_tokens": last.prompt_tokens,
        "generated_tokens": last.generation_tokens,
    }


if __name__ == "__main__":
    model_dir, prompt_file, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(prompt_file) as f:
        prompt = json.load(f)
    print(json.dumps(measure(model_dir, prompt, max_tokens)))
