"""Where the user types: Enter sends, Shift+Enter starts a new line. Editing a sent
message happens here too, in place of the draft, which comes back after."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent, QTextCursor
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

ADDING_TIP = "A model is being added: send your message when that ends"


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
    edit_requested = Signal(int, str)  # a sent message, and its new text
    stop_requested = Signal()
    send_held = Signal()  # Enter while a reply is written or a model added: the text waits
    editing_changed = Signal(object)  # the message being edited, or None once not

    def __init__(self) -> None:
        super().__init__()
        self.edit = MessageEdit()
        self.edit.setPlaceholderText("Message (Enter sends, Shift+Enter for a new line)")
        self.edit.setFixedHeight(72)
        self.edit.setTabChangesFocus(True)  # Tab leaves the box, as everywhere else
        self.button = QPushButton("Send")
        self.button.setMinimumWidth(80)
        self.banner = QLabel("Editing your message: Enter sends it as a new branch; Esc cancels")
        self.banner.hide()
        row = QHBoxLayout()
        row.addWidget(self.edit)
        row.addWidget(self.button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.banner)
        layout.addLayout(row)
        self.generating = False
        self.waiting = False
        self.editing: int | None = None  # the message being edited
        self._original = ""  # its text before the edit
        self._draft = ""  # what was typed before the edit began
        self.edit.submitted.connect(self.send)
        self.button.clicked.connect(self._clicked)

    def set_generating(self, generating: bool) -> None:
        self.generating = generating
        self.button.setText("Stop" if generating else "Send")
        if not generating and self.button.hasFocus():  # a click on Stop left it there
            self.edit.setFocus()

    def set_waiting(self, waiting: bool) -> None:
        """While a model is being added: Send waits (greyed out), and Enter keeps the
        text in the box; the button is no Stop, as there is no reply to stop."""
        self.waiting = waiting
        self.button.setEnabled(not waiting)
        self.button.setToolTip(ADDING_TIP if waiting else "")

    def begin_edit(self, message_id: int, text: str) -> None:
        """Put a sent message here to be rewritten; the draft waits until it is done."""
        if self.editing is None:
            self._draft = self.edit.toPlainText()
        self.editing, self._original = message_id, text
        self.editing_changed.emit(message_id)
        self.edit.setPlainText(text)
        self.edit.moveCursor(QTextCursor.MoveOperation.End)
        self.edit.setFocus()
        self.banner.show()

    def cancel_edit(self) -> None:
        if self.editing is None:
            return
        self.editing = None
        self.editing_changed.emit(None)
        self.edit.setPlainText(self._draft)
        self.edit.moveCursor(QTextCursor.MoveOperation.End)  # typing goes on after it
        self.banner.hide()

    def draft(self) -> str:
        """What the user typed and has not sent (during an edit, what waits for it)."""
        return self._draft if self.editing is not None else self.edit.toPlainText()

    def show_draft(self, text: str) -> None:
        """Another chat's draft in the box, the cursor at its end; an edit under way is
        given up (its message stays as it was)."""
        self.cancel_edit()
        self.edit.setPlainText(text)
        self.edit.moveCursor(QTextCursor.MoveOperation.End)

    def _clicked(self) -> None:
        if self.generating:
            self.stop_requested.emit()
        else:
            self.send()
        # Back to typing: left on the button (Stop once the reply began), the next
        # space typed stopped the reply and the words were lost (a new-user walk).
        self.edit.setFocus()

    def send(self) -> None:
        text = self.edit.toPlainText().strip()
        busy = self.generating or self.waiting
        if text and busy:
            self.send_held.emit()
        if not text or busy:
            return
        if self.editing is not None:
            message_id, changed = self.editing, text != self._original.strip()
            self.cancel_edit()  # the draft comes back
            if changed:
                self.edit_requested.emit(message_id, text)
            return
        self.edit.clear()
        self.send_requested.emit(text)
