"""Logging to a file under the platform's log folder (`sessions.paths.log_dir`).

Bugs are logged with their traceback there; the user sees a short message
that names the file. Called once by each entry point (window, terminal).
"""

from __future__ import annotations

import logging
from logging.handlers import RotatingFileHandler

from sessions import paths

_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s"


def setup_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger()
    if any(getattr(h, "reprise", False) for h in root.handlers):
        return
    try:
        handler = RotatingFileHandler(
            paths.log_file(), maxBytes=2_000_000, backupCount=2, encoding="utf-8"
        )
    except OSError:  # an unwritable log folder must not stop the app
        handler = logging.StreamHandler()
        handler.setLevel(logging.WARNING)
    handler.reprise = True
    handler.setFormatter(logging.Formatter(_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
