"""Above the chat: the settings this chat runs with, and its own system prompt."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

from sessions.conversations import Conversation

PREVIEW = 80  # characters of the system prompt shown


def header_text(model: str, own_prompt: str | None, default_prompt: str) -> str:
    """One line: the model, and the system prompt with where it comes from."""
    if own_prompt:
        prompt = f"System prompt (this chat): “{_preview(own_prompt)}”"
    elif default_prompt:
        prompt = f"System prompt (default): “{_preview(default_prompt)}”"
    else:
        prompt = "No system prompt"
    return f"{model} · {prompt}" if model else prompt


def _preview(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= PREVIEW else line[: PREVIEW - 1] + "…"


class ChatHeader(QWidget):
    system_prompt_requested = Signal()  # the user wants to change this chat's prompt

    def __init__(self) -> None:
        super().__init__()
        self.label = QLabel("")
        self.label.setTextFormat(Qt.TextFormat.PlainText)  # the prompt is the user's text
        self.edit = QPushButton("System prompt…")
        self.edit.setToolTip(
            "Give this chat its own system prompt; leave it empty to use the default "
            "from Preferences"
        )
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 0, 4, 0)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.edit)
        self.edit.clicked.connect(self.system_prompt_requested)

    def show(self, chat: Conversation | None, model: str, default_prompt: str) -> None:
        """The chat on screen; None: a chat not started yet, which runs with the defaults
        (its own prompt can be set once it exists)."""
        own = chat.system_prompt if chat is not None else None
        self.label.setText(header_text(model, own, default_prompt))
        self.label.setToolTip(own or default_prompt)
        self.edit.setEnabled(chat is not None)
