"""CPU probe behind the README's figures for templates that rewrite replies (issue 14):
a `bench reopen --shape` model of random weights whose chat template writes earlier
replies in a "final" channel, as gpt-oss's does. After ~`tokens` of history and a
first turn, the next turns' TTFT in the engine that never closed and in a reopened
one, with where each turn's cache came from. Run from the project root:

    .venv/bin/python docs/probes/rewritten_replies_probe.py gemma3-1b 2048 MODEL_DIR

MODEL_DIR: an imported starter model (for its tokenizer).
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


def report(label: str, done) -> None:
    r = done.restore
    print(
        f"  {label}: ttft {done.ttft_s:.3f} s, {r.source}: {r.tokens} of {r.prompt_tokens}"
        f" tokens restored in {r.seconds:.3f} s",
        flush=True,
    )


def main() -> None:
    shape, tokens, tokenizer_dir = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    scratch = tempfile.mkdtemp()
    for kind in ("DATA", "CACHE", "CONFIG"):
        os.environ[f"REPRISE_{kind}_DIR"] = f"{scratch}/{kind.lower()}"
    import app.engine  # noqa: F401 (OpenBLAS before mlx)
    from app.bench.reopen import build_history, run_turn
    from app.engine import loading
    from app.engine.conversation import ConversationEngine
    from sessions.db import open_db

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
    for n in (2, 3):
        report(f"never closed, turn {n}", run_turn(engine, conversation.id, f"In {n} words?")[0])
    reopened = ConversationEngine(open_db(), loaded)
    report("reopened", run_turn(reopened, conversation.id, "Once more?")[0])


if __name__ == "__main__":
    main()
