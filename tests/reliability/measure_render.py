"""Time and memory to render each hostile reply in the real chat view (a benchmark, not a test).

    .venv/bin/python tests/reliability/measure_render.py [--timeout S] [--json OUT]

Each reply is rendered in a fresh process (so peak memory is its own), in a shown ChatView
of 800x600 offscreen, between a user message and another: the figure is show_messages
(setHtml, which lays out a shown document) plus document().size(). A run past the timeout
is reported as such. `app` is imported from sys.path, so the same script measures another
checkout: PYTHONPATH=/path/to/other/checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def measure_one(name: str) -> dict:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from hostile_replies import ALL
    from PySide6.QtWidgets import QApplication

    from app.ui.chat_view import ChatView
    from app.ui.render import RenderedMessage

    qt = QApplication([])
    view = ChatView()
    view.resize(800, 600)
    view.show()
    qt.processEvents()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    messages = [
        RenderedMessage(1, "user", "hi"),
        RenderedMessage(2, "assistant", ALL[name]),
        RenderedMessage(3, "user", "AFTER-MARK"),
    ]
    started = time.perf_counter()
    view.show_messages(messages)
    height = view.document().size().height()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "name": name,
        "input_chars": len(ALL[name]),
        "html_chars": len(view.toHtml()),
        "seconds": round(seconds, 3),
        "height_px": round(height),
        "peak_rss_mb": round(peak / 1024),
        "rss_growth_mb": round((peak - before) / 1024),
        "transcript_intact": "AFTER-MARK" in view.toPlainText(),
        "resources_refused": getattr(view, "refused_resources", None),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(args.one)))
        return 0
    from hostile_replies import ALL

    rows = []
    for name in ALL:
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--one", name],
                capture_output=True,
                text=True,
                timeout=args.timeout,
                check=False,
            )
            lines = done.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else None
            row = row or {"name": name, "error": done.stderr.strip().splitlines()[-1:]}
        except subprocess.TimeoutExpired:
            row = {"name": name, "error": f"still running after {args.timeout:.0f} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
