"""How long a raced turn's setup takes before its prefill starts, cold and warm.

`python docs/probes/race_clock_probe.py MODEL_DIR [TOKENS]`: a chat of about TOKENS
tokens (1,500) saved, then reopened four times by new engines with races on, the files
dropped from the page cache before every other one; prints the time from the race's start
(its read begins) to the prefill's first step (the user's message stored between, an SQLite
commit). The sixteenth session's H100 trace put 70-80 ms there on a cold 1.9 GB read.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ["REPRISE_DATA_DIR"] = tempfile.mkdtemp()
os.environ["REPRISE_CACHE_DIR"] = tempfile.mkdtemp()

import app.engine  # noqa: F401  (OpenBLAS before mlx)
from app.bench.reopen import build_history, cache_files, evict, run_turn
from app.engine import loading, restore_race
from app.engine.conversation import ConversationEngine
from sessions.db import open_db
from sessions.measurements import Measurements


def main() -> None:
    loaded = loading.load(Path(sys.argv[1]))
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1500
    builder = ConversationEngine(open_db(), loaded)
    builder.planner.measurements = Measurements(open_db(Path(tempfile.mkdtemp()) / "b.db"))
    chat = builder.store.create(loaded.name)
    build_history(builder, chat.id, tokens)
    run_turn(builder, chat.id, "Summarise this.")
    gaps = []
    starts = restore_race.RestoreRace.prefill_starts

    def noted(race: restore_race.RestoreRace) -> None:
        starts(race)
        gaps.append(race.prefill_started - race.created)

    restore_race.RestoreRace.prefill_starts = noted
    for cold in (True, False, True, False):
        engine = ConversationEngine(open_db(), loaded)
        engine.races.enabled = True
        for key in engine.planner.measurements.starting_with(engine.planner.prefill_prefix):
            engine.planner.measurements.forget(key)  # the size not measured: a race
        if cold:
            evict(cache_files(engine, chat.id))
        finished, _ = run_turn(engine, chat.id, "And?")
        took = f"{gaps[-1] * 1000:.1f} ms"
        print("cold" if cold else "warm", "race start to prefill:", took, finished.restore.source)


if __name__ == "__main__":
    main()
