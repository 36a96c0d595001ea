"""The Models dialog's "Found on this computer": other tools' models, with Import or Use."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QLabel,
    QPushButton,
    QTreeWidget,
    QTreeWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.engine import found
from app.engine.found import Discovery, FoundModel

ACTION_COLUMN = 3
PLACES = "LM Studio's, Ollama's and Hugging Face's folders, and Downloads"
LOOKING = f"Looking in {PLACES}…"
_PRESS_KEYS = (Qt.Key.Key_Return, Qt.Key.Key_Enter, Qt.Key.Key_Space)


class _Rows(QTreeWidget):
    """Enter or Space on a row presses its Import or Use button: Tab never reaches a
    button inside the list, and Enter went on to the dialog's Close."""

    def keyPressEvent(self, event: QKeyEvent) -> None:
        row = self.currentItem()
        if event.key() in _PRESS_KEYS and row is not None:
            button = self.itemWidget(row, ACTION_COLUMN)
            if button is not None and button.isEnabled():
                button.click()
            event.accept()
            return
        super().keyPressEvent(event)


class FoundList(QWidget):
    """Filled from the worker's `models_found`; a row's button asks for its import or use."""

    import_requested = Signal(str, str)  # GGUF path, model name
    use_requested = Signal(str, str)  # MLX folder, model name

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = QLabel("<b>Found on this computer</b>")
        self.status = QLabel(LOOKING)
        self.status.setWordWrap(True)
        self.table = _Rows()
        self.table.setHeaderLabels(["Name", "Source", "Size", ""])
        self.table.setRootIsDecorated(False)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.title)
        layout.addWidget(self.table)
        layout.addWidget(self.status)

    def looking(self) -> None:
        self.status.setText(LOOKING)

    def show_found(self, discovery: Discovery | None) -> None:
        self.table.clear()
        if discovery is None:
            self.status.setText("Looking for models failed; the log has the details.")
            return
        for item in discovery.found:
            self._add_row(item)
        self.table.resizeColumnToContents(0)
        count = len(discovery.found)
        text = f"{count} model{'s' if count != 1 else ''} found" if count else "No models found"
        text += f" in {PLACES}."
        if discovery.skipped:
            text += f" {len(discovery.skipped)} skipped (hover for why)."
        self.status.setText(text)
        self.status.setToolTip("\n".join(f"{s.path}: {s.reason}" for s in discovery.skipped[:40]))

    def _add_row(self, item: FoundModel) -> None:
        how = "GGUF, imported into the library" if item.kind == found.GGUF else "MLX, used in place"
        row = QTreeWidgetItem([item.label, item.source, f"{item.size_bytes / 1e6:,.0f} MB"])
        row.setToolTip(0, f"{item.path}\n{how} (Enter or the button)")
        self.table.addTopLevelItem(row)
        if item.installed_as:
            button = QPushButton("Installed")
            button.setToolTip(f"In the library as {item.installed_as}")
            button.setEnabled(False)
        else:
            button = QPushButton("Import" if item.kind == found.GGUF else "Use")
            button.clicked.connect(lambda _=False, chosen=item: self._act(chosen))
        button.setAutoDefault(False)
        self.table.setItemWidget(row, ACTION_COLUMN, button)

    def button(self, row: int) -> QPushButton:
        return self.table.itemWidget(self.table.topLevelItem(row), ACTION_COLUMN)

    def _act(self, item: FoundModel) -> None:
        wanted = self.import_requested if item.kind == found.GGUF else self.use_requested
        wanted.emit(str(item.path), item.name)
