"""The small questions the window asks the user, each one dialog and its answer."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtGui import QKeySequence, QShortcut, QTextCursor
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

# Characters a one-line box shows at once (Qt's default showed about 20).
LINE_CHARACTERS = 50


def new_title(parent: QWidget, current: str) -> str | None:
    """A new title for a chat; None when cancelled or blank."""
    return one_line(parent, "Rename", "Title:", current)


def model_name(parent: QWidget, offered: str) -> str | None:
    """The name a model is imported under; None when cancelled or blank."""
    return one_line(parent, "Import GGUF", "Model name:", offered)


def one_line(parent: QWidget, title: str, label: str, text: str) -> str | None:
    """A line the user types, starting from `text`, in a box wide enough to read a
    title or a model's name whole; None when cancelled or blank."""
    dialog = QInputDialog(parent)
    dialog.setWindowTitle(title)
    dialog.setLabelText(label)
    dialog.setTextValue(text)
    dialog.resize(dialog.fontMetrics().averageCharWidth() * LINE_CHARACTERS, 0)
    if not dialog.exec():
        return None
    answer = dialog.textValue()
    return answer if answer.strip() else None


def confirm_delete(parent: QWidget, title: str) -> bool:
    """Yes only when chosen: Enter keeps the chat (there is no undo)."""
    buttons = QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.No
    answer = QMessageBox.question(
        parent,
        "Delete",
        f"Delete “{title or 'this chat'}”? Its messages and what was saved to reopen it "
        "are deleted. This cannot be undone.",
        buttons,
        QMessageBox.StandardButton.No,
    )
    return answer == QMessageBox.StandardButton.Yes


_EXPORT_FORMATS = {"markdown": ("Markdown", ".md"), "json": ("JSON", ".json")}


def _export_filter(fmt: str) -> str:
    kind, suffix = _EXPORT_FORMATS[fmt]
    return f"{kind} (*{suffix})"


def export_path(parent: QWidget, title: str, fmt: str) -> tuple[str, str] | None:
    """Where to export a chat and in which format: `fmt` offered first, the other beside
    it; None when cancelled."""
    filters = {_export_filter(name): name for name in _EXPORT_FORMATS}
    start = str(Path.home() / f"{export_name(title)}{_EXPORT_FORMATS[fmt][1]}")
    path, chosen = QFileDialog.getSaveFileName(
        parent, "Export", start, ";;".join(filters), _export_filter(fmt)
    )
    if not path:
        return None
    return path, export_format(path, filters.get(chosen, fmt))


def export_format(path: str, chosen: str) -> str:
    """The format a name asks for by its ending, else the one chosen (a walk typed
    "penguin.json" with Markdown chosen and got Markdown under that name)."""
    by_suffix = {suffix: name for name, (_, suffix) in _EXPORT_FORMATS.items()}
    return by_suffix.get(Path(path).suffix.lower(), chosen)


class PromptDialog(QDialog):
    """A chat's own system prompt: Enter starts a new line, Tab moves on to OK,
    Ctrl+Enter saves from anywhere."""

    def __init__(self, parent: QWidget | None, current: str, default: str) -> None:
        super().__init__(parent)
        self.setWindowTitle("System prompt")
        # The header's words for an empty prompt: "the model's own", or the default's.
        empty = f"the default from Preferences: “{default}”" if default else "the model's own"
        label = QLabel(f"This chat's system prompt (left empty: {empty})")
        label.setWordWrap(True)
        self.text = QPlainTextEdit(current)
        self.text.moveCursor(QTextCursor.MoveOperation.End)  # it goes on from what is there
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
