"""Start the desktop app."""

from __future__ import annotations

import os
import sys

from PySide6.QtWidgets import QApplication

from app import __version__


def has_display() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def run() -> int:
    if not has_display():
        print(
            "reprise: no display found. Start it from a desktop session, or on a headless "
            "machine run `xvfb-run reprise`; `reprise chat` works in any terminal.",
            file=sys.stderr,
        )
        return 1
    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("Reprise")
    app.setApplicationVersion(__version__)
    from app.ui.main_window import MainWindow

    window = MainWindow()
    window.show()
    return app.exec()
