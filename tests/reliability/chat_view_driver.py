"""Drive a real ChatView as a user would: read what it shows, find its links, click them."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import Qt
from PySide6.QtGui import QTextCursor

from app.ui.chat_view import ChatView


@dataclass
class Link:
    text: str
    href: str
    position: int


def shown_text(view: ChatView) -> str:
    """What the user reads (the break opportunities the view adds in long runs removed)."""
    return view.toPlainText().replace("\u200b", "")


def links(view: ChatView) -> list[Link]:
    """Every link in the document, in order."""
    found = []
    block = view.document().begin()
    while block.isValid():
        for item in block:
            fragment = item.fragment()
            char_format = fragment.charFormat()
            if char_format.isAnchor() and char_format.anchorHref():
                found.append(Link(fragment.text(), char_format.anchorHref(), fragment.position()))
        block = block.next()
    return found


def click_at(qtbot, view: ChatView, position: int) -> None:
    """A left click on the character after document position `position`."""
    cursor = QTextCursor(view.document())
    cursor.setPosition(position + 1)
    view.setTextCursor(cursor)
    view.ensureCursorVisible()
    point = view.cursorRect(cursor).center()
    point.setX(point.x() - 2)  # onto the character before the cursor's line
    qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton, pos=point)


def click_text(qtbot, view: ChatView, text: str, occurrence: int = 0) -> None:
    """Click on the `occurrence`th place `text` is shown, link or not."""
    cursor = QTextCursor(view.document())
    for _ in range(occurrence + 1):
        cursor = view.document().find(text, cursor)
        assert not cursor.isNull(), f"{text!r} is not shown {occurrence + 1} times"
    click_at(qtbot, view, cursor.selectionStart())
