"""Conversations, newest first, with search, New chat and per-entry actions."""

from __future__ import annotations

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


def describe_cache(info: dict | None) -> str:
    if not info or not info.get("bytes"):
        return "no saved cache"
    return f"cache {info['bytes'] / 1e6:.1f} MB, {info['tokens']:,} tokens"


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

    def show_conversations(
        self, entries: list[tuple[int, str, dict | None]], current: int | None
    ) -> None:
        """entries: (id, title, cache info) in display order."""
        self.list.blockSignals(True)
        self.list.clear()
        for conversation_id, title, cache in entries:
            item = QListWidgetItem(f"{title or 'New chat'}\n{describe_cache(cache)}")
            item.setData(Qt.ItemDataRole.UserRole, conversation_id)
            item.setToolTip(title)
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
