"""Conversations, newest first, with search, New chat and per-entry actions. A search's
result shows the matching text with the words searched for in bold."""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from datetime import date, datetime

from PySide6.QtCore import QModelIndex, QPersistentModelIndex, QSize, Qt, Signal
from PySide6.QtGui import (
    QAbstractTextDocumentLayout,
    QKeyEvent,
    QPainter,
    QPalette,
    QTextDocument,
)
from PySide6.QtWidgets import (
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from app.ui.typing_to import pass_letters

SNIPPET_CHARS = 60
ELSEWHERE = "(on another branch)"
MARKED_ROLE = Qt.ItemDataRole.UserRole + 1  # a result's lines as HTML, the match in bold
ELSEWHERE_ROLE = Qt.ItemDataRole.UserRole + 2  # a match on a hidden branch: its message id
_PADDING = 4  # around a row's text: the focus ring (3 pixels) goes there


@dataclass(frozen=True)
class SidebarEntry:
    conversation_id: int
    title: str
    cache: dict | None
    updated: str  # ISO time of the last change
    snippet: str = ""  # a search's matching text
    elsewhere: bool = False  # the match is on a branch not on screen
    message_id: int | None = None  # the matching message
    empty: bool = False  # no message yet (made for its settings before its first)


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
    if start > 0 and flat[start - 1] != " ":  # begin at a word, not inside one
        space = flat.find(" ", start, at)
        start = space + 1 if space >= 0 else at
    piece = flat[start : start + SNIPPET_CHARS]
    return ("…" if start else "") + piece + ("…" if start + SNIPPET_CHARS < len(flat) else "")


def marked(text: str, query: str) -> str:
    """`text` as HTML, every occurrence of the query's words in bold."""
    words = sorted({w for w in query.split() if w}, key=len, reverse=True)
    if not words:
        return html.escape(text)
    pattern = re.compile("|".join(re.escape(w) for w in words), re.IGNORECASE)
    parts, at = [], 0
    for match in pattern.finditer(text):
        parts += [html.escape(text[at : match.start()]), f"<b>{html.escape(match[0])}</b>"]
        at = match.end()
    return "".join([*parts, html.escape(text[at:])])


class ResultDelegate(QStyledItemDelegate):
    """Draws a search result: the item as the style draws it (background, selection,
    focus), then its lines as rich text, the title and day cut to the width."""

    def _document(self, option: QStyleOptionViewItem, index: QModelIndex) -> QTextDocument:
        lines = index.data(Qt.ItemDataRole.DisplayRole).splitlines()
        width = max(1, option.rect.width() - 2 * _PADDING)
        metrics = option.fontMetrics
        head = [metrics.elidedText(t, Qt.TextElideMode.ElideRight, width) for t in lines[:2]]
        document = QTextDocument()
        document.setDocumentMargin(0)
        document.setDefaultFont(option.font)
        document.setHtml("<br>".join([*map(html.escape, head), index.data(MARKED_ROLE)]))
        document.setTextWidth(width)
        return document

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        if not index.data(MARKED_ROLE):
            super().paint(painter, option, index)
            return
        item = QStyleOptionViewItem(option)
        self.initStyleOption(item, index)
        document = self._document(item, index)
        item.text = ""
        style = item.widget.style() if item.widget else None
        if style is not None:
            style.drawControl(QStyle.ControlElement.CE_ItemViewItem, item, painter, item.widget)
        selected = bool(item.state & QStyle.StateFlag.State_Selected)
        context = QAbstractTextDocumentLayout.PaintContext()
        role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text
        context.palette.setColor(QPalette.ColorRole.Text, item.palette.color(role))
        painter.save()
        painter.translate(item.rect.left() + _PADDING, item.rect.top() + _PADDING)
        document.documentLayout().draw(painter, context)
        painter.restore()

    def sizeHint(
        self, option: QStyleOptionViewItem, index: QModelIndex | QPersistentModelIndex
    ) -> QSize:
        size = super().sizeHint(option, index)
        if not index.data(MARKED_ROLE):  # room for the focus ring above and below the text
            return QSize(size.width(), size.height() + 2 * _PADDING)
        item = QStyleOptionViewItem(option)
        self.initStyleOption(item, index)
        if item.widget is not None:
            item.rect.setWidth(item.widget.viewport().width())
        height = int(self._document(item, index).size().height()) + 2 * _PADDING
        return QSize(size.width(), height)


def describe_cache(info: dict | None, empty: bool = False) -> str:
    """Whether the chat's saved state lets its next reply start at once, in a user's
    words (a new user's walk: "no cache saved", "598 tokens" meant nothing; a later one:
    "reads the chat again when continued" meant nothing either, least of all for a chat
    with no message). Its size is the tooltip's (`saved_size`): on the line it was cut
    off, even at the window's usual width."""
    if empty:
        return "no messages yet"
    if not info or not info.get("bytes"):
        return "resumes by rereading"  # its text is kept all the same
    if info.get("chunks_on_disk", 0) < info.get("chunks", 0):  # some made room for others
        return "resumes in part"
    return "resumes at once"


def saved_size(info: dict | None) -> str:
    """The disk space the chat's saved state takes, said as such beside the status bar's
    "chat in memory" (a walk took the two for one number that disagreed)."""
    if not info or not info.get("bytes"):
        return ""
    return f"Saved to resume it: {info['bytes'] / 1e6:.1f} MB on disk"


class ChatList(QListWidget):
    """The chats. Letters typed here go into the message box (`typing_to`), not to the
    list's jump-to-a-title search."""

    def __init__(self) -> None:
        super().__init__()
        self.type_into: QWidget | None = None

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if not pass_letters(event, self.type_into):
            super().keyPressEvent(event)


class Sidebar(QWidget):
    conversation_selected = Signal(int)
    clicked = Signal()  # a chat chosen with the mouse (the keyboard stays in the list)
    match_opened = Signal(int, int)  # a search result on a hidden branch: chat, message
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
        self.list = ChatList()
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        # A long title ends in "…" (the full one is its tooltip), not a sideways scrollbar.
        self.list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.list.setItemDelegate(ResultDelegate(self.list))
        self.list.setResizeMode(QListWidget.ResizeMode.Adjust)  # results re-wrap to the width
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 6, 6, 6)
        layout.addWidget(self.new_button)
        layout.addWidget(self.search)
        self.no_matches = QLabel()  # a search that found nothing says so
        self.no_matches.setTextFormat(Qt.TextFormat.PlainText)  # the query as typed, tags too
        self.no_matches.setWordWrap(True)
        self.no_matches.hide()
        layout.addWidget(self.no_matches)
        layout.addWidget(self.list)
        self.setMinimumWidth(170)  # titles are cut (their ends elided), never the buttons
        self.new_button.clicked.connect(self.new_requested)
        self.search.textChanged.connect(self.search_changed)
        # Selected, not made current: Tab into the list makes its first row current
        # (to show the focus there) and must not open that chat.
        self.list.itemSelectionChanged.connect(self._selected)
        self.list.itemActivated.connect(self._activated)  # Enter on the current row
        self.list.itemClicked.connect(self.clicked)
        self.search.returnPressed.connect(self._to_results)
        self.list.customContextMenuRequested.connect(self._menu)

    def keyPressEvent(self, event) -> None:
        """Down in the search box goes to the results (the box has no use for it)."""
        if event.key() == Qt.Key.Key_Down and self.search.hasFocus():
            self._to_results()
            return
        super().keyPressEvent(event)

    def _to_results(self) -> None:
        """From the search box to the list, the first result opened."""
        if self.list.count():
            self.list.setFocus()
            self.list.setCurrentRow(0)
            self.list.item(0).setSelected(True)

    def _activated(self, item: QListWidgetItem) -> None:
        if not item.isSelected():
            item.setSelected(True)  # opens it (`_selected`)

    def show_conversations(self, entries: list[SidebarEntry], current: int | None) -> None:
        """Entries in display order: the title, the day and the cache; a search's match."""
        self.list.blockSignals(True)
        self.list.clear()
        for entry in entries:
            conversation_id = entry.conversation_id
            when = day_label(entry.updated)
            lines = [
                entry.title or "New chat",
                " · ".join(filter(None, [when, describe_cache(entry.cache, entry.empty)])),
            ]
            found = entry.snippet + (f" {ELSEWHERE}" if entry.elsewhere else "")
            item = QListWidgetItem("\n".join([*lines, found] if entry.snippet else lines))
            if entry.snippet:
                note = f" <i>{ELSEWHERE}</i>" if entry.elsewhere else ""
                item.setData(MARKED_ROLE, marked(entry.snippet, self.search.text()) + note)
            item.setData(Qt.ItemDataRole.UserRole, conversation_id)
            if entry.elsewhere:
                item.setData(ELSEWHERE_ROLE, entry.message_id)
            item.setToolTip("\n".join(filter(None, [entry.title, saved_size(entry.cache)])))
            self.list.addItem(item)
            # A match on a hidden branch of the chat on screen is not what is shown:
            # left unselected, choosing it switches to its branch.
            if conversation_id == current and not entry.elsewhere:
                self.list.setCurrentItem(item)
        self.list.blockSignals(False)
        query = self.search.text().strip()
        stop = "" if query.endswith((".", "!", "?")) else "."  # not "“a joke.”." (a walk)
        self.no_matches.setText(f"No message mentions “{query}”{stop}" if query else "")
        self.no_matches.setVisible(bool(query) and not entries)

    def select(self, conversation_id: int | None) -> None:
        """Highlight the chat on view (none for a new chat), without asking to show it."""
        self.list.blockSignals(True)
        self.list.clearSelection()
        self.list.setCurrentRow(-1)
        for row in range(self.list.count()):
            if self.list.item(row).data(Qt.ItemDataRole.UserRole) == conversation_id:
                self.list.setCurrentRow(row)
        self.list.blockSignals(False)

    def neighbour(self, conversation_id: int) -> int | None:
        """The chat listed after this one, or else before it: the one to show once it is
        deleted (a chat app's habit; two new-user walks expected it)."""
        ids = [
            self.list.item(row).data(Qt.ItemDataRole.UserRole) for row in range(self.list.count())
        ]
        if conversation_id not in ids or len(ids) < 2:
            return None
        row = ids.index(conversation_id)
        return ids[row + 1] if row + 1 < len(ids) else ids[row - 1]

    def _selected(self) -> None:
        items = self.list.selectedItems()
        if not items:
            return
        conversation_id = items[0].data(Qt.ItemDataRole.UserRole)
        hidden_match = items[0].data(ELSEWHERE_ROLE)
        if hidden_match is not None:  # open the chat on the branch the match is on
            self.match_opened.emit(conversation_id, hidden_match)
        else:
            self.conversation_selected.emit(conversation_id)

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
