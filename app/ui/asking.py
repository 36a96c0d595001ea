"""The small questions the window asks the user, each one dialog and its answer."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtWidgets import QFileDialog, QInputDialog, QMessageBox, QWidget

from app.ui.reading import export_name


def new_title(parent: QWidget, current: str) -> str | None:
    """A new title for a chat; None when cancelled or blank."""
    title, ok = QInputDialog.getText(parent, "Rename", "Title:", text=current)
    return title if ok and title.strip() else None


def confirm_delete(parent: QWidget, title: str) -> bool:
    answer = QMessageBox.question(
        parent, "Delete", f"Delete “{title or 'this chat'}” and its cache?"
    )
    return answer == QMessageBox.StandardButton.Yes


def export_path(parent: QWidget, title: str, fmt: str) -> str | None:
    """Where to export a chat as `fmt`; None when cancelled."""
    suffix = ".md" if fmt == "markdown" else ".json"
    start = str(Path.home() / f"{export_name(title)}{suffix}")
    name, _ = QFileDialog.getSaveFileName(parent, "Export", start)
    return name or None


def system_prompt(parent: QWidget, current: str, default: str) -> str | None:
    """This chat's own system prompt as the user set it ("" for the default); None when
    cancelled or unchanged."""
    label = "This chat's system prompt (empty: the default from Preferences"
    label += f": “{default}”)" if default else ")"
    text, ok = QInputDialog.getMultiLineText(parent, "System prompt", label, current)
    return text.strip() if ok and text.strip() != current else None
