"""CPU probe behind the README's figures for templates that rewrite replies (issue 14):
a `bench reopen --shape` model of random weights whose chat template writes earlier
replies in a "final" channel, as gpt-oss's does. After ~`tokens` of history and a
first turn, the next turns' TTFT in the engine that never closed and in a reopened
one, with where each turn's cache came from, and what taking the checkpoint before the
generation prompt and going back to it in memory cost. Run from the project root:

    .venv/bin/python docs/probes/rewritten_replies_probe.py gemma3-1b 2048 MODEL_DIR [TURNS]

MODEL_DIR: an imported starter model (for its tokenizer); TURNS: the next turns asked
in the engine that never closed (default 2).
"""

import json
import os
import sys
import tempfile
import time
from pathlib import Path

CHANNEL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}final: {% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def model_with_channel_template(shape: str, tokenizer_dir: Path, out: Path) -> Path:
    from app.bench import shapes

    folder = shapes.model_folder(shape, tokenizer_dir, out)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = CHANNEL_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def report(label: str, done, timed: dict[str, list[float]]) -> None:
    r = done.restore
    costs = "".join(f", {name} {1e3 * sum(s):.1f} ms" for name, s in timed.items() if s)
    print(
        f"  {label}: ttft {done.ttft_s:.3f} s, {r.source}: {r.tokens} of {r.prompt_tokens}"
        f" tokens restored in {r.seconds:.3f} s{costs}",
        flush=True,
    )
    for seconds in timed.values():
        seconds.clear()


def timing(cls, names: tuple[str, ...]) -> dict[str, list[float]]:
    """Each call of `cls`'s methods `names` timed (they copy to host memory or evaluate:
    the time is the work's)."""
    timed: dict[str, list[float]] = {}
    for name in names:
        method, seconds = getattr(cls, name), timed.setdefault(name, [])

        def timed_call(*args, _method=method, _seconds=seconds, **kwargs):
            started = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                _seconds.append(time.perf_counter() - started)

        setattr(cls, name, timed_call)
    return timed


def main() -> None:
    shape, tokens, tokenizer_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    turns = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    scratch = tempfile.mkdtemp()
    for kind in ("DATA", "CACHE", "CONFIG"):
        os.environ[f"REPRISE_{kind}_DIR"] = f"{scratch}/{kind.lower()}"
    import app.engine  # noqa: F401 (OpenBLAS before mlx)
    from app.bench.reopen import build_history, run_turn
    from app.engine import loading
    from app.engine.conversation import ConversationEngine
    from app.engine.kvstore import KVStore
    from sessions.db import open_db

    timed = timing(KVStore, ("take_checkpoint", "resume"))

    loaded = loading.load(model_with_channel_template(shape, tokenizer_dir, Path(scratch)))
    engine = ConversationEngine(open_db(), loaded)
    conversation = engine.store.create(loaded.name)
    build_history(engine, conversation.id, tokens)
    started = time.perf_counter()
    done, _ = run_turn(engine, conversation.id, "Summarise this.")
    print(
        f"{shape}, {done.restore.prompt_tokens} tokens:"
        f" first turn {time.perf_counter() - started:.1f} s"
    )
    timed_turn = timed["take_checkpoint"][-1:]
    print(f"  (its checkpoint before the generation prompt: {1e3 * sum(timed_turn):.1f} ms)")
    for seconds in timed.values():
        seconds.clear()
    for n in range(2, 2 + turns):
        done = run_turn(engine, conversation.id, f"In {n} words?")[0]
        report(f"never closed, turn {n}", done, timed)
    reopened = ConversationEngine(open_db(), loaded)
    report("reopened", run_turn(reopened, conversation.id, "Once more?")[0], timed)


if __name__ == "__main__":
    main()
