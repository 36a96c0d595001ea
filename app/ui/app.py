"""Start the desktop app."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from app import __version__
from app.resource_files import resource

# Qt's folders (QStandardPaths' AppDataLocation, CacheLocation) are
# <generic>/<organization>/<application>, platformdirs' are <generic>/Reprise
# (sessions/paths.py): so the application name is "Reprise" and the organization
# name stays empty, and both libraries name the same folders. The domain only
# names the app to macOS (QSettings) and desktops; the .desktop file is reprise.desktop.
APPLICATION_NAME = "Reprise"
ORGANIZATION_NAME = ""
ORGANIZATION_DOMAIN = "reprise.app"
DESKTOP_FILE = "reprise"
ICON_SIZES = (16, 32, 48, 64, 128, 256, 512)


def has_display() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("QT_QPA_PLATFORM"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def app_icon() -> QIcon:
    icon = QIcon()
    for size in ICON_SIZES:
        icon.addFile(str(resource(f"icons/reprise-{size}.png")))
    return icon


def name_application(app: QApplication) -> None:
    app.setApplicationName(APPLICATION_NAME)
    # No display name: Qt would append it to every title ("Reprise 0.1.0 — Reprise").
    app.setOrganizationName(ORGANIZATION_NAME)
    app.setOrganizationDomain(ORGANIZATION_DOMAIN)
    app.setApplicationVersion(__version__)
    app.setDesktopFileName(DESKTOP_FILE)
    app.setWindowIcon(app_icon())


def run() -> int:
    if not has_display():
        print(
            "reprise: no display found. Start it from a desktop session, or on a headless "
            "machine run `xvfb-run reprise`; `reprise chat` works in any terminal.",
            file=sys.stderr,
        )
        return 1
    app = QApplication.instance() or QApplication(sys.argv)
    name_application(app)
    from app.ui import first_run, smoke, theme

    theme.controller()  # the system's light or dark from the start, first-run dialog too
    from app.ui.main_window import MainWindow

    smoke_folder = Path(os.environ["REPRISE_SMOKE"]) if os.environ.get("REPRISE_SMOKE") else None
    empty = first_run.needs_first_run()
    window = MainWindow()
    if smoke_folder:
        smoke.WindowDriver(window, smoke_folder)
    window.show()
    if empty:
        first_run.welcome(window, smoke.drive_first_run(smoke_folder) if smoke_folder else None)
    return app.exec()
