"""CPU probe behind the README's per-turn threads figures (issue 14): the engine's
turns (`ChatSession.generate`) on the starter model, a prompt of `context` tokens
and then follow-ups of 17 tokens with 32 tokens of reply each, with the thread
count chosen per turn (app/engine/cpu_threads.py) and with two threads fixed
(`REPRISE_BLAS_THREADS=2`, what OpenBLAS does by itself), alternated. Each
follow-up comes a second after the last turn. Run from the project root:

    .venv/bin/python docs/probes/turn_threads_probe.py MODEL_DIR 1024
    (timeout 600 sh -c 'while :; do :; done' &); .venv/bin/python docs/probes/...
        the same beside a process that keeps one core busy
"""

import os
import random
import statistics
import sys
import time

from app.engine.chat import ChatSession  # app.engine loads OpenBLAS before mlx
from app.engine.generation import SamplingSettings, TurnFinished
from app.engine.loading import load


def follow_ups(session: ChatSession, prompt: list[int], rounds: int) -> list:
    stats = []
    for _ in range(rounds):
        time.sleep(1.0)
        prompt = prompt + [random.randrange(100, 20000) for _ in range(17)]
        events = list(session.generate(prompt, sampling=SamplingSettings(max_tokens=32, seed=0)))
        finished = events[-1]
        assert isinstance(finished, TurnFinished)
        stats.append(finished.stats)
        prompt = session.tokens
    return stats


def main() -> None:
    folder, context = sys.argv[1], int(sys.argv[2])
    loaded = load(folder)
    random.seed(1)
    prompt = [random.randrange(100, 20000) for _ in range(context)]
    rows = {"per turn": [], "2 fixed": []}
    for _ in range(3):
        for label in rows:
            if label == "2 fixed":
                os.environ["REPRISE_BLAS_THREADS"] = "2"
            else:
                os.environ.pop("REPRISE_BLAS_THREADS", None)
            session = ChatSession(loaded)
            list(session.generate(prompt, sampling=SamplingSettings(max_tokens=1, seed=0)))
            rows[label] += follow_ups(session, session.tokens, 3)
    for label, stats in rows.items():
        ttft = statistics.median(s.ttft_s for s in stats)
        decode = statistics.median(s.generated_tokens / s.decode_s for s in stats if s.decode_s)
        print(
            f"{context} tokens, threads {label}: follow-up TTFT {ttft * 1e3:.0f} ms, "
            f"decode {decode:.1f} tok/s ({len(stats)} turns)"
        )


if __name__ == "__main__":
    main()
