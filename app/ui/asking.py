"""The small questions the window asks the user, each one dialog and its answer."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QInputDialog,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QVBoxLayout,
    QWidget,
)

from app.ui.reading import export_name

# Characters of a title the Rename box shows at once (Qt's default showed about 20).
TITLE_CHARACTERS = 50


def new_title(parent: QWidget, current: str) -> str | None:
    """A new title for a chat; None when cancelled or blank."""
    dialog = QInputDialog(parent)
    dialog.setWindowTitle("Rename")
    dialog.setLabelText("Title:")
    dialog.setTextValue(current)
    dialog.resize(dialog.fontMetrics().averageCharWidth() * TITLE_CHARACTERS, 0)
    if not dialog.exec():
        return None
    title = dialog.textValue()
    return title if title.strip() else None


def confirm_delete(parent: QWidget, title: str) -> bool:
    """Yes only when chosen: Enter keeps the chat (there is no undo)."""
    buttons = QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No
    answer = QMessageBox.question(
        parent,
        "Delete",
        f"Delete “{title or 'this chat'}” and its cache? This cannot be undone.",
        buttons,
        QMessageBox.StandardButton.No,
    )
    return answer == QMessageBox.StandardButton.Yes


def export_path(parent: QWidget, title: str, fmt: str) -> str | None:
    """Where to export a chat as `fmt`; None when cancelled."""
    suffix, kind = (".md", "Markdown") if fmt == "markdown" else (".json", "JSON")
    start = str(Path.home() / f"{export_name(title)}{suffix}")
    name, _ = QFileDialog.getSaveFileName(parent, "Export", start, f"{kind} (*{suffix})")
    return name or None


class PromptDialog(QDialog):
    """A chat's own system prompt: Enter starts a new line, Tab moves on to OK,
    Ctrl+Enter saves from anywhere."""

    def __init__(self, parent: QWidget | None, current: str, default: str) -> None:
        super().__init__(parent)
        self.setWindowTitle("System prompt")
        said = f": “{default}”" if default else ""
        label = QLabel(f"This chat's system prompt (empty: the default from Preferences{said})")
        label.setWordWrap(True)
        self.text = QPlainTextEdit(current)
        self.text.setTabChangesFocus(True)
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.button(QDialogButtonBox.StandardButton.Ok).setDefault(True)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self, activated=self.accept)
        layout = QVBoxLayout(self)
        layout.addWidget(label)
        layout.addWidget(self.text)
        layout.addWidget(buttons)
        self.resize(520, 240)


def system_prompt(parent: QWidget, current: str, default: str) -> str | None:
    """This chat's own system prompt as the user set it ("" for the default); None when
    cancelled or unchanged."""
    dialog = PromptDialog(parent, current, default)
    if not dialog.exec():
        return None
    text = dialog.text.toPlainText().strip()
    return text if text != current else None
