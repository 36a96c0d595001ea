"""Quitting: stop a reply, and wait for the worker to finish its save, showing a
"Saving…" box if that takes more than a moment."""

from __future__ import annotations

from PySide6.QtCore import QElapsedTimer, Qt
from PySide6.QtWidgets import QApplication, QProgressDialog, QWidget

from app.ui.turn_status import PROGRESS_AFTER_MS
from app.worker import WorkerThread

SAVING = "Saving the conversation…"
ADDING = "Finishing adding the model…"


def wait_for_worker(engine: WorkerThread, parent: QWidget, what: str = SAVING) -> None:
    """Stop what the worker does, and wait for it, saying `what` if that takes a while."""
    engine.worker.stop()
    engine.thread.quit()
    clock = QElapsedTimer()
    clock.start()
    waiting = None
    while not engine.thread.wait(50):
        if waiting is None and clock.elapsed() > PROGRESS_AFTER_MS:
            waiting = QProgressDialog(what, "", 0, 0, parent)
            waiting.setCancelButton(None)
            waiting.setWindowModality(Qt.WindowModality.WindowModal)
            waiting.show()
        QApplication.processEvents()
    if waiting is not None:
        waiting.close()
