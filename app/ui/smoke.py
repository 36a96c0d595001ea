"""`REPRISE_SMOKE=FOLDER reprise`: the app drives itself through a first start, as
`make package-test` needs from a bundle with no test runner in it: accept the
starter-model import, send one message, wait for the reply, quit. It saves
screenshots of the whole screen into FOLDER at each stage and prints one JSON
line with the reply's stats; the exit status is 0 only if the turn finished."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from PySide6.QtCore import QObject, QTimer, Slot
from PySide6.QtWidgets import QApplication

from app.ui.first_run import FirstRunDialog

SMOKE_MESSAGE = "Say hello in one short sentence."


def shoot(folder: Path, name: str) -> None:
    QApplication.processEvents()
    screen = QApplication.primaryScreen()
    screen.grabWindow(0).save(str(folder / f"{name}.png"))


def drive_first_run(folder: Path):
    """A callback for `offer_starter_model`: shoot the offer, accept it, shoot the progress."""

    def on_shown(dialog: FirstRunDialog) -> None:
        shot: list[bool] = []

        def on_first_value(_value: int) -> None:
            if not shot:
                shot.append(True)
                shoot(folder, "2-importing")

        def accept() -> None:
            shoot(folder, "1-first-run")
            dialog.progress.valueChanged.connect(on_first_value)
            dialog.import_starter()

        QTimer.singleShot(300, accept)

    return on_shown


class WindowDriver(QObject):
    """Once the model is loaded, send one message; quit when the reply is stored. A
    QObject on the GUI thread, so the worker's signals reach its slots queued here."""

    def __init__(self, window, folder: Path) -> None:
        super().__init__(window)
        self.window = window
        self.folder = folder
        worker = window.engine.worker
        worker.model_loaded.connect(self.on_loaded)
        worker.finished.connect(self.on_finished)
        worker.failed.connect(self.on_failed)

    @Slot(str, str)
    def on_loaded(self, _name: str, _compute: str) -> None:
        shoot(self.folder, "3-ready")
        self.window.composer.edit.setPlainText(SMOKE_MESSAGE)
        self.window.composer.button.click()

    @Slot(object)
    def on_finished(self, reply) -> None:
        print(json.dumps({"smoke": "ok", "reply": reply.text, **reply.to_dict()}), flush=True)
        QTimer.singleShot(200, self.finish)

    @Slot()
    def finish(self) -> None:
        shoot(self.folder, "4-reply")
        self.window.close()
        QApplication.instance().exit(0)

    @Slot(str)
    def on_failed(self, message: str) -> None:
        print(json.dumps({"smoke": "failed", "message": message}), file=sys.stderr, flush=True)
        QApplication.instance().exit(1)
