"""Conversations, newest first, with search, New chat and per-entry actions."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

SNIPPET_CHARS = 60


@dataclass(frozen=True)
class SidebarEntry:
    conversation_id: int
    title: str
    cache: dict | None
    updated: str  # ISO time of the last change
    snippet: str = ""  # a search's matching text


def day_label(iso_time: str, today: date | None = None) -> str:
    """ "Today", "Yesterday", a weekday within the week, else the date (local time)."""
    try:
        day = datetime.fromisoformat(iso_time).astimezone().date()
    except ValueError:
        return ""
    today = today or datetime.now().astimezone().date()
    age = (today - day).days
    if age == 0:
        return "Today"
    if age == 1:
        return "Yesterday"
    if 1 < age < 7:
        return day.strftime("%A")
    return day.isoformat()


def snippet(text: str, query: str) -> str:
    """The part of `text` around the first word of `query` it holds, on one line."""
    flat = " ".join(text.split())
    words = [w for w in query.lower().split() if w]
    at = min((i for i in (flat.lower().find(w) for w in words) if i >= 0), default=0)
    start = max(0, at - SNIPPET_CHARS // 3)
    piece = flat[start : start + SNIPPET_CHARS]
    return ("…" if start else "") + piece + ("…" if start + SNIPPET_CHARS < len(flat) else "")


def describe_cache(info: dict | None) -> str:
    if not info or not info.get("bytes"):
        return "nothing saved yet"
    # "saved": the size on disk; the status bar says "in memory" for the other size.
    return f"saved {info['bytes'] / 1e6:.1f} MB, {info['tokens']:,} tokens"


class Sidebar(QWidget):
    conversation_selected = Signal(int)
    new_requested = Signal()
    search_changed = Signal(str)
    rename_requested = Signal(int)
    delete_requested = Signal(int)
    export_requested = Signal(int, str)  # id, "markdown" | "json"

    def __init__(self) -> None:
        super().__init__()
        self.new_button = QPushButton("New chat")
        self.search = QLineEdit()
        self.search.setPlaceholderText("Search messages")
        self.search.setClearButtonEnabled(True)
        self.list = QListWidget()
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        # A long title ends in "…" (the full one is its tooltip), not a sideways scrollbar.
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        layout.addWidget(self.list)
        self.setMinimumWidth(220)
        self.new_button.clicked.connect(self.new_requested)
        self.search.textChanged.connect(self.search_changed)
        self.list.currentItemChanged.connect(self._selected)
        self.list.customContextMenuRequested.connect(self._menu)

    def show_conversations(self, entries: list[SidebarEntry], current: int | None) -> None:
        """Entries in display order: the title, the day and the cache; a search's match."""
        self.list.blockSignals(True)
        self.list.clear()
        for entry in entries:
            conversation_id = entry.conversation_id
            when = day_label(entry.updated)
            lines = [
                entry.title or "New chat",
                " · ".join(filter(None, [when, describe_cache(entry.cache)])),
            ]
            if entry.snippet:
                lines.append(entry.snippet)
            item = QListWidgetItem("\n".join(lines))
            item.setData(Qt.ItemDataRole.UserRole, conversation_id)
            item.setToolTip(entry.title)
            self.list.addItem(item)
            if conversation_id == current:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)

    def select(self, conversation_id: int | None) -> None:
        """Highlight the chat on view (none for a new chat), without asking to show it."""
        self.list.blockSignals(True)
        self.list.clearSelection()
        self.list.setCurrentRow(-1)
        for row in range(self.list.count()):
            if self.list.item(row).data(Qt.ItemDataRole.UserRole) == conversation_id:
                self.list.setCurrentRow(row)
        self.list.blockSignals(False)

    def _selected(self, item: QListWidgetItem | None) -> None:
        if item is not None:
            self.conversation_selected.emit(item.data(Qt.ItemDataRole.UserRole))

    def _menu(self, position) -> None:
        item = self.list.itemAt(position)
        if item is None:
            return
        conversation_id = item.data(Qt.ItemDataRole.UserRole)
        menu = QMenu(self)
        menu.addAction("Rename…", lambda: self.rename_requested.emit(conversation_id))
        menu.addAction(
            "Export as Markdown…", lambda: self.export_requested.emit(conversation_id, "markdown")
        )
        menu.addAction(
            "Export as JSON…", lambda: self.export_requested.emit(conversation_id, "json")
        )
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.delete_requested.emit(conversation_id))
        menu.exec(self.list.mapToGlobal(position))
