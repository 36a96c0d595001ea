"""`reprise bench ui`: the window's own speed, offscreen.

- `first_paint`: seconds from starting a fresh Python process to the main window's first
  paint (what a user waits before seeing anything), the median of a few starts.

Qt is allowed here (and only here in app.bench): the bench drives the real window.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

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


def main(args: argparse.Namespace) -> int:
    rows = [{"measure": "first_paint_s", "value": round(first_paint_s(), 3)}]
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
    else:
        for row in rows:
            print(f"{row['measure']:<16} {row['value']}")
    return 0
