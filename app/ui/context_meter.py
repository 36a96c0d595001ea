"""Under the composer: how much of the model's context the chat and the draft take, and,
before a message that will not fit, a warning with a way forward."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

from app.ui.theme import chat_colours

if TYPE_CHECKING:  # the service (and so the engine) is imported on the worker's thread
    from app.service.chat import ContextUse


def meter_text(use: ContextUse) -> str:
    draft = f" + {use.draft:,} in the draft" if use.draft else ""
    return f"Context: {use.conversation:,} tokens{draft} of {use.limit:,}"


def warning_text(use: ContextUse) -> str:
    if use.draft >= use.limit:  # no new chat can hold it either
        return (
            f"Too long to send: the message alone is {use.draft:,} tokens and the model "
            f"reads {use.limit:,}. Shorten it, or send it in parts."
        )
    total = use.conversation + use.draft
    way = "send it in a new chat" if use.conversation_id is not None else "split it"
    return (
        f"Too long to send: the chat would be {total:,} tokens and the model reads "
        f"{use.limit:,}. Shorten the message, or {way}."
    )


class ContextMeter(QWidget):
    new_chat_requested = Signal()  # "Send in a new chat"

    def __init__(self) -> None:
        super().__init__()
        self.label = QLabel("")
        self.label.setWordWrap(True)
        self.fresh = QPushButton("Send in a new chat")
        self.fresh.setToolTip("Start a new chat with this message; this chat stays as it is")
        self.fresh.hide()
        layout = QHBoxLayout(self)
        layout.setContentsMargins(2, 0, 2, 0)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.fresh)
        self.use: ContextUse | None = None
        self.fresh.clicked.connect(self.new_chat_requested)

    def show_if_current(self, use: ContextUse, conversation_id: int | None, draft: str) -> None:
        """Show a count only if it is of the chat and the draft on screen now."""
        if use.conversation_id == conversation_id and use.draft_text == draft:
            self.show_use(use)

    def known_not_to_fit(self, conversation_id: int | None, text: str) -> bool:
        """Whether the last count already says that `text` does not fit this chat."""
        use = self.use
        counted = use is not None and use.conversation_id == conversation_id
        return counted and use.draft_text.strip() == text and not use.fits

    def show_use(self, use: ContextUse) -> None:
        self.use = use
        if use.fits:
            self.label.setText(meter_text(use))
            self.label.setStyleSheet("")
        else:
            self.label.setText(warning_text(use))
            self.label.setStyleSheet(f"color: {chat_colours().warning}")
        alone_fits = use.draft < use.limit
        self.fresh.setVisible(not use.fits and use.conversation_id is not None and alone_fits)

    def clear(self) -> None:
        self.use = None
        self.label.setText("")
        self.fresh.hide()
