"""Letters typed where they cannot go (the conversation, the chat list) go into the
message box, which takes the keyboard: after a click on a link, or a search result opened
with Enter, what was typed next was lost (new-user walks)."""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QApplication, QWidget

# The modifiers of plain typing; AltGr types @, { or € on many keyboards.
_TYPING = (
    Qt.KeyboardModifier.ShiftModifier
    | Qt.KeyboardModifier.KeypadModifier
    | Qt.KeyboardModifier.GroupSwitchModifier
)


def pass_letters(event: QKeyEvent, target: QWidget | None) -> bool:
    """Send a typed letter on to `target` (which takes the keyboard); whether it was one.
    Tab, Enter, Space, arrows and shortcuts are not: they stay where they were pressed."""
    text = event.text()
    letters = text.isprintable() and bool(text.strip())
    if target is None or not letters or event.modifiers() & ~_TYPING:
        return False
    target.setFocus()
    QApplication.sendEvent(target, event)
    return True
