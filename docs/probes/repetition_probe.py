"""How often the starter model loops at the app's default sampling, by repetition penalty.

A reply "loops" when some run of 8 words occurs 3 times or more in it. Eight everyday
requests, each sampled with seeds 0..N-1 at temperature 0.7, top-p 0.95, at most 400
tokens.

    .venv/bin/python docs/probes/repetition_probe.py <model folder> 1.0,1.1 3

7 December 2026, this 2-core CPU, SmolLM2-135M-Instruct (the starter):
    1.0 {'replies': 24, 'looped': 4, 'hit_limit': 5, 'median_tokens': 160}
    1.1 {'replies': 24, 'looped': 0, 'hit_limit': 2, 'median_tokens': 98}
Greedy, "Write a short poem about the sea.": at 1.0 one line of eight words 14 times, to
the 300-token limit; at 1.1 it ends after 86 tokens (tests/test_starter_model.py).
"""
import collections
import json
import sys

import app.engine  # noqa: F401
from app.engine.chat import ChatSession
from app.engine.generation import SamplingSettings, TurnFinished
from app.engine.loading import load

PROMPTS = [
    "Hi! Who are you?",
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a rainbow forms.",
    "Give me three tips for sleeping better.",
    "What should I cook for dinner tonight?",
    "Tell me a joke.",
    "Summarize the plot of Romeo and Juliet.",
]


def loops(text: str) -> bool:
    words = text.split()
    runs = collections.Counter(tuple(words[i : i + 8]) for i in range(len(words) - 7))
    return bool(runs) and runs.most_common(1)[0][1] >= 3


loaded = load(sys.argv[1])
penalties = [float(p) for p in sys.argv[2].split(",")]
seeds = range(int(sys.argv[3]))
rows = {}
for penalty in penalties:
    looped = capped = 0
    lengths = []
    for seed in seeds:
        for prompt in PROMPTS:
            session = ChatSession(loaded)
            sampling = SamplingSettings(repetition_penalty=penalty, max_tokens=400, seed=seed)
            events = list(session.reply([{"role": "user", "content": prompt}], sampling=sampling))
            done = events[-1]
            assert isinstance(done, TurnFinished)
            n = done.stats.generated_tokens
            lengths.append(n)
            capped += n >= 400
            looped += loops(done.text)
            if seed == 0 and prompt == PROMPTS[3]:
                print(penalty, repr(done.text[:300]), file=sys.stderr)
    total = len(PROMPTS) * len(seeds)
    rows[penalty] = {"replies": total, "looped": looped, "hit_limit": capped,
                     "median_tokens": sorted(lengths)[len(lengths) // 2]}
    print(penalty, rows[penalty], flush=True)
print(json.dumps(rows))
