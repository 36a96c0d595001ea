"""`reprise bench ui`: the window's own speed, offscreen.

- `first_paint`: seconds from starting a fresh Python process to the main window's first
  paint (what a user waits before seeing anything), the median of a few starts.
- `stream`: a reply streamed into a conversation of 10, 50 and 200 messages in the real
  window; `max_gap_ms` is the largest gap of a 5 ms timer on the event loop meanwhile
  (what a user feels as a stutter). The reply's text comes from another thread through
  the worker's own `text_delta` signal (queued, as in a turn), at a fast model's pace, so
  the figure is the window's alone, whatever model is installed.

Qt is allowed here (and only here in app.bench): the bench drives the real window.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Run in a fresh process: the clock starts before Python itself does.
_FIRST_PAINT = """
import sys, time
import app.engine
from PySide6.QtCore import QEvent, QObject, QTimer
from PySide6.QtWidgets import QApplication
app = QApplication(sys.argv)
from app.ui.main_window import MainWindow

class FirstPaint(QObject):
    def eventFilter(self, watched, event):
        if event.type() == QEvent.Type.Paint:
            print(f"painted {time.time()!r}", flush=True)
            QTimer.singleShot(0, app.quit)
        return False

window = MainWindow()
painted = FirstPaint()
window.installEventFilter(painted)
window.show()
app.exec()
window.close()
"""


def first_paint_s(runs: int = 3, python: str = sys.executable, env: dict | None = None) -> float:
    """The median seconds from process start to the main window's first paint."""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", **(env or {})}
    times = []
    for _ in range(runs):
        started = time.time()
        done = subprocess.run(
            [python, "-c", _FIRST_PAINT],
            env=env,
            cwd="/",  # not a checkout: `-c` puts the folder first on the path
            capture_output=True,
            text=True,
            timeout=300,
        )
        line = next((x for x in done.stdout.splitlines() if x.startswith("painted ")), None)
        if line is None:
            raise RuntimeError(f"the window did not paint:\n{done.stderr[-2000:]}")
        times.append(float(line.split()[1]) - started)
    return statistics.median(times)


REPLY = "Here is a line of the reply with `code` and **bold** words, number {}.\n\n"
SIZES = (10, 50, 200)
DELTAS, DELTA_S = 150, 0.02  # three seconds at 50 tokens/s


def _message_text(i: int) -> str:
    code = f"\n```python\ndef step_{i}(x):\n    return x * {i}\n```\n" if i % 3 == 0 else ""
    return f"Message {i}: " + "a sentence of ordinary prose, " * 8 + code


def _conversation(messages: int) -> int:
    """A stored conversation of `messages` messages (in the bench's own folders)."""
    from sessions.conversations import ConversationStore
    from sessions.db import open_db

    store = ConversationStore(open_db())
    conversation = store.create("bench")
    parent = None
    for i in range(messages):
        role = "user" if i % 2 == 0 else "assistant"
        parent = store.add_message(conversation.id, role, _message_text(i), parent_id=parent).id
    return conversation.id


def stream_row(messages: int) -> dict:
    """Stream a reply into a chat of `messages` messages; the event loop's largest gap."""
    import threading

    from PySide6.QtCore import QElapsedTimer, QTimer
    from PySide6.QtWidgets import QApplication

    from app.ui.main_window import MainWindow

    app = QApplication.instance() or QApplication([])
    window = MainWindow()
    window.engine.worker.failed.disconnect(window.on_failed)  # no model needed: no dialog
    window.show()
    window.show_conversation(_conversation(messages))
    window.turns.start()
    ticks: list[int] = []
    clock = QElapsedTimer()
    clock.start()
    timer = QTimer(interval=5)
    timer.timeout.connect(lambda: ticks.append(clock.elapsed()))

    def stream() -> None:
        for i in range(DELTAS):
            window.engine.worker.text_delta.emit(REPLY.format(i) if i % 10 == 0 else "word ")
            time.sleep(DELTA_S)

    sender = threading.Thread(target=stream)
    timer.start()
    sender.start()
    while sender.is_alive():
        app.processEvents()
        time.sleep(0.001)
    for _ in range(50):  # the last refresh
        app.processEvents()
        time.sleep(0.002)
    timer.stop()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    window.close()
    return {"messages": messages + 1, "max_gap_ms": max(gaps), "ticks": len(ticks)}


def main(args: argparse.Namespace) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        for name in ("data", "cache", "log"):
            os.environ[f"REPRISE_{name.upper()}_DIR"] = str(Path(folder) / name)
        os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
        stream_row(2)  # warm-up: first-use imports (highlighters) are not the window's pace
        rows = [stream_row(n) for n in SIZES]
        rows.append({"measure": "first_paint_s", "value": round(first_paint_s(), 3)})
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return 0
    for row in rows:
        if "messages" in row:
            print(f"{row['messages']:>4} messages  max gap {row['max_gap_ms']:>5} ms")
        else:
            print(f"first paint      {row['value']} s")
    return 0
