"""Where the user types: Enter sends, Shift+Enter starts a new line."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QHBoxLayout, QPlainTextEdit, QPushButton, QWidget


class MessageEdit(QPlainTextEdit):
    submitted = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        enter = event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter)
        if enter and not event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


class Composer(QWidget):
    send_requested = Signal(str)
    stop_requested = Signal()

    def __init__(self) -> None:
        super().__init__()
        self.edit = MessageEdit()
        self.edit.setPlaceholderText("Message (Enter sends, Shift+Enter for a new line)")
        self.edit.setFixedHeight(72)
        self.edit.setTabChangesFocus(True)  # Tab leaves the box, as everywhere else
        self.button = QPushButton("Send")
        self.button.setMinimumWidth(80)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.edit)
        layout.addWidget(self.button)
        self.generating = False
        self.edit.submitted.connect(self.send)
        self.button.clicked.connect(self._clicked)

    def set_generating(self, generating: bool) -> None:
        self.generating = generating
        self.button.setText("Stop" if generating else "Send")

    def _clicked(self) -> None:
        if self.generating:
            self.stop_requested.emit()
        else:
            self.send()

    def send(self) -> None:
        text = self.edit.toPlainText().strip()
        if text and not self.generating:
            self.edit.clear()
            self.send_requested.emit(text)
