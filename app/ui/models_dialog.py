"""The model library: list, delete, import a GGUF file (with progress), download from the
hub, and the models other tools keep on this computer (imported, or used in place)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QDialog,
    QFileDialog,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMessageBox,
    QProgressBar,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
)

from app.engine import models
from app.engine.found import gguf_file_problem, imported_as
from app.ui import asking
from app.ui.first_run import suggested_name
from app.ui.found_list import FoundList
from app.ui.theme import RoomForTheRing
from sessions import paths

# Where a model came from, in words (a new user's walk read "gguf" and "mlx" as jargon).
SOURCES = {"gguf": "Imported GGUF", "mlx": "MLX folder", "in place": "Used in place"}


def size_text(size: int) -> str:
    """MB below a gigabyte, as first start says the starter's size (it said 0.10 GB here
    and 98 MB there)."""
    if size >= 1e9:
        return f"{size / 1e9:.2f} GB"
    return f"{size / 1e6:.1f} MB" if size < 1e7 else f"{size / 1e6:.0f} MB"


class ModelsDialog(QDialog):
    import_requested = Signal(str, str)  # path, name
    download_requested = Signal(str)  # repo id
    use_requested = Signal(str, str)  # MLX folder, name
    find_requested = Signal()

    def __init__(self, worker, parent=None, in_use: str = "") -> None:
        super().__init__(parent)
        self.in_use = in_use  # the model the window has loaded: not deleted from here
        self.setWindowTitle("Models")
        self.resize(820, 560)
        self.table = QTreeWidget()
        # What a user chooses by first; how the weights are stored is each row's tooltip
        # (a new user's walk stopped at "Q4_1 as 4-bit (exact)" in a column of its own).
        self.table.setHeaderLabels(["Name", "Size", "Context", "Source", "Architecture"])
        self.table.setRootIsDecorated(False)
        self.table.setItemDelegate(RoomForTheRing(self.table))
        self.found = FoundList()
        self.progress = QProgressBar()
        self.progress.hide()
        self.message = QLabel("")
        self.message.setWordWrap(True)  # why an import failed can be a sentence or two
        import_button = QPushButton("Import GGUF…")
        folder_button = QPushButton("Add MLX folder…")
        download_button = QPushButton("Download from Hugging Face…")
        self.cancel_button = QPushButton("Cancel download")
        self.cancel_button.hide()
        delete_button = QPushButton("Delete")
        close_button = QPushButton("Close")
        buttons = QHBoxLayout()
        buttons.addWidget(import_button)
        buttons.addWidget(folder_button)
        buttons.addWidget(download_button)
        buttons.addWidget(self.cancel_button)
        buttons.addWidget(delete_button)
        buttons.addStretch(1)
        buttons.addWidget(close_button)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("<b>Installed</b>"))
        layout.addWidget(self.table, 1)
        layout.addWidget(self.found, 1)
        layout.addWidget(self.progress)
        layout.addWidget(self.message)
        layout.addLayout(buttons)
        import_button.clicked.connect(self.choose_gguf)
        folder_button.clicked.connect(self.choose_folder)
        delete_button.clicked.connect(self.delete_selected)
        close_button.clicked.connect(self.accept)
        for button in (import_button, folder_button, download_button, delete_button):
            button.setAutoDefault(False)  # Enter closes; it does not open a file picker
        close_button.setDefault(True)
        download_button.clicked.connect(self.ask_repo)
        # Direct: the worker thread is busy downloading; this only sets its stop flag.
        self.cancel_button.clicked.connect(worker.stop, Qt.ConnectionType.DirectConnection)
        self.download_requested.connect(worker.download_model)
        worker.download_progress.connect(self.on_download_progress)
        self.import_requested.connect(worker.import_gguf)
        worker.import_progress.connect(self.on_progress)
        worker.model_added.connect(self.on_done)
        self.found.import_requested.connect(self.start_import)
        self.found.use_requested.connect(self.start_use)
        self.use_requested.connect(worker.use_folder)
        self.find_requested.connect(worker.find_models)
        worker.models_found.connect(self.found.show_found)
        self.refresh()
        self.find_requested.emit()  # answered on the worker's thread: the dialog is up at once

    def refresh(self) -> None:
        self.table.clear()
        for m in models.list_models(paths.models_dir()):
            shown = f"{m.name} (in use)" if m.name == self.in_use else m.name
            context = f"{m.context_length:,} tokens" if m.context_length else "unknown"
            source = SOURCES.get(m.source, m.source)
            item = QTreeWidgetItem(
                [shown, size_text(m.size_bytes), context, source, m.architecture]
            )
            item.setData(0, Qt.ItemDataRole.UserRole, m.name)
            for column in range(item.columnCount()):
                item.setToolTip(column, f"Weights: {m.weights}")
            if m.in_place:
                item.setToolTip(3, f"Used in place from {m.in_place}; Delete removes only the link")
            self.table.addTopLevelItem(item)
        for column in range(self.table.columnCount() - 1):
            self.table.resizeColumnToContents(column)

    def choose_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(
            self, "Import GGUF", str(Path.home()), "GGUF models (*.gguf)"
        )
        if not path:
            return
        problem = gguf_file_problem(Path(path))  # before a name is asked for (new-user walk)
        if problem is not None:
            self.message.setText(f"{Path(path).name} is {problem}: nothing was added.")
            return
        already = _already_imported(Path(path))
        if already:  # a second copy under another name (a new user's walk made one)
            self.message.setText(
                f"{Path(path).name} is in the library already, as {already}: nothing was added."
            )
            return
        name = asking.model_name(self, suggested_name(Path(path)))
        if name is not None:
            self.start_import(path, name.strip())

    def choose_folder(self) -> None:
        """An MLX model's folder anywhere (only the terminal's `reprise models use` took
        one before: a walk); used in place, under its folder's name, as a found one is."""
        folder = QFileDialog.getExistingDirectory(self, "Add an MLX model folder", str(Path.home()))
        if folder:
            self.start_use(folder, Path(folder).name)

    def start_import(self, path: str, name: str) -> None:
        self.progress.setRange(0, 4)
        self.progress.setValue(0)
        self.progress.show()
        self.message.setText(f"Importing {Path(path).name}…")
        self.import_requested.emit(path, name)

    def start_use(self, folder: str, name: str) -> None:
        self.message.setText(f"Adding {name} (used in place)…")
        self.use_requested.emit(folder, name)

    def ask_repo(self) -> None:
        repo, ok = QInputDialog.getText(
            self,
            "Download from Hugging Face",
            "Model on the hub, by name or page address (for example "
            "mlx-community/Qwen3-1.7B-4bit):",
        )
        if ok and repo.strip():
            self.start_download(repo.strip())

    def start_download(self, repo_id: str) -> None:
        self.progress.setRange(0, 0)
        self.progress.show()
        self.cancel_button.show()
        self.message.setText(f"Downloading {repo_id}…")
        self.download_requested.emit(repo_id)

    def on_download_progress(self, done: int, total: int, file: str) -> None:
        scale = max(1, total // 1_000_000)  # QProgressBar takes ints; keep them small
        self.progress.setRange(0, total // scale)
        self.progress.setValue(done // scale)
        self.message.setText(f"{file}  {done / 1e6:.1f} of {total / 1e6:.1f} MB")

    def on_progress(self, stage: str, done: int, total: int) -> None:
        self.progress.setRange(0, total)
        self.progress.setValue(done)
        self.message.setText(stage)

    def on_done(self, name: str, why: str) -> None:
        """An import, download or link ended: what was added, or why nothing was, here
        where it was asked for (the window's status bar is behind the dialog)."""
        self.progress.hide()
        self.cancel_button.hide()
        self.message.setText(f"Added {name}" if name else why)
        self.refresh()
        if name:  # what was just added is marked as installed in the found list
            self.found.looking()
            self.find_requested.emit()

    def delete_selected(self) -> None:
        item = self.table.currentItem()
        if item is None:  # (a new user's walk pressed Delete and nothing happened)
            self.message.setText("Choose a model in the list above, then Delete.")
            return
        name = item.data(0, Qt.ItemDataRole.UserRole)
        if name == self.in_use:
            other = "choose another" if self.table.topLevelItemCount() > 1 else "add another"
            self.message.setText(
                f"{name} is the model in use: {other} and load it from the toolbar first."
            )
            return
        linked = (paths.models_dir() / name).is_symlink()
        question = (
            f"Remove {name} from the library? Its folder stays where it is."
            if linked
            else f"Delete {name} from disk?"
        )
        answer = QMessageBox.question(self, "Delete model", question)
        if answer == QMessageBox.StandardButton.Yes:
            models.delete(name, paths.models_dir())
            self.refresh()
            self.find_requested.emit()


def _already_imported(gguf: Path) -> str:
    """The library name of a model imported from this very file (its name and size)."""
    try:
        size = gguf.stat().st_size
    except OSError:
        return ""
    return imported_as(gguf.name, size, models.list_models(paths.models_dir()))
