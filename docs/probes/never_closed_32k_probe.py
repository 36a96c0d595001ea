"""GPU probe behind the README's "never closed at 32k" figures (issue 14): one engine
that never closes, a `bench reopen --shape` model of random weights with `tokens` of
history, then three new messages and two edits of the last, with saving on and then
off; each turn's first token, its save, the time to read every layer's keys once,
and mlx's memory. `asis` puts back the save's old read (a view of each layer read
on the host, which mlx-cuda answers by moving the whole buffer to managed memory);
`fixed` runs the code as it is. Run from the project root on the device (README,
"H100" section, for the wheels):

    python3 docs/probes/never_closed_32k_probe.py qwen3-1.7b 32768 fixed|asis TOKENIZER_DIR
"""

import os
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    shape, tokens, mode, tokenizer_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    scratch = tempfile.mkdtemp()
    for kind in ("DATA", "CACHE", "CONFIG"):
        os.environ[f"REPRISE_{kind}_DIR"] = f"{scratch}/{kind.lower()}"
    import app.engine  # noqa: F401, I001 (OpenBLAS before mlx on the CPU)
    import mlx.core as mx
    import numpy as np

    from app.bench import shapes
    from app.bench.reopen import ONE_TOKEN, build_history, run_turn
    from app.engine import codecs, loading, snapshots
    from app.engine.conversation import ConversationEngine
    from app.engine.kvstore import SaveReport
    from sessions.db import open_db

    if mode == "asis":

        def old_to_numpy(array: mx.array) -> np.ndarray:
            return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)

        codecs.to_numpy = snapshots.to_numpy = old_to_numpy

    folder = shapes.model_folder(shape, Path(tokenizer_dir), Path(scratch) / "models")
    engine = ConversationEngine(open_db(), loading.load(folder))
    conversation = engine.store.create(shape)
    build_history(engine, conversation.id, tokens)
    label = f"[{shape} {tokens} {mode}]"

    def memory() -> str:
        gb = 1e9
        return (
            f"act={mx.get_active_memory() / gb:.2f} cache={mx.get_cache_memory() / gb:.2f}"
            f" peak={mx.get_peak_memory() / gb:.2f}GB"
        )

    def read_all() -> float:
        arrays = [a for layer in engine.session.cache for a in layer.state]
        mx.synchronize()
        started = time.perf_counter()
        mx.eval([mx.sum(a) for a in arrays if isinstance(a, mx.array)])
        mx.synchronize()
        return time.perf_counter() - started

    done, saved = run_turn(engine, conversation.id, "Summarise this.")
    print(f"{label} first turn: ttft {done.ttft_s:.3f} save {saved.report.seconds:.3f} {memory()}")

    def turns(tag: str, new: int) -> None:
        for n in range(new):
            done, saved = run_turn(engine, conversation.id, f"And in {n + 1} words?")
            print(
                f"{label} {tag} new {n}: ttft {done.ttft_s:.3f} save {saved.report.seconds:.3f}"
                f" | read_all {read_all():.4f} {memory()}",
                flush=True,
            )
        user = engine.store.message(done.message_id).parent_id
        for n in range(2):
            events = list(engine.edit(user, f"And in {n + 5} words?", ONE_TOKEN))
            print(f"{label} {tag} edit {n}: ttft {events[-2].ttft_s:.3f} | {memory()}", flush=True)

    turns("saves-on", 3)
    engine.kvstore.save = lambda *args, **kwargs: SaveReport()
    turns("saves-off", 2)


if __name__ == "__main__":
    main()
