"""Start the desktop app."""

from __future__ import annotations

import sys

from PySide6.QtWidgets import QApplication

from app import __version__


def run() -> int:
    app = QApplication.instance() or QApplication(sys.argv)
    app.setApplicationName("Reprise")
    app.setApplicationVersion(__version__)
    from app.ui.main_window import MainWindow

    window = MainWindow()
    window.show()
    return app.exec()
