"""The conversation, rendered as HTML; links in it are actions (copy, edit, ...)."""

from __future__ import annotations

from PySide6.QtCore import QTimer, QUrl, Signal
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QTextBrowser

from app.ui.render import RenderedMessage, code_blocks, conversation_html, split_thinking

# Re-render a streaming reply at most this often: smooth, and cheap for the event loop.
_STREAM_REFRESH_MS = 60


class ChatView(QTextBrowser):
    action = Signal(str, int)  # verb, message id ("edit", "regenerate", "branch-prev", ...)

    def __init__(self) -> None:
        super().__init__()
        self.setOpenLinks(False)
        self.setObjectName("chatView")
        self.anchorClicked.connect(self._on_link)
        self.messages: list[RenderedMessage] = []
        self._thinking_open: set[int] = set()
        self._refresh = QTimer(self, singleShot=True, interval=_STREAM_REFRESH_MS)
        self._refresh.timeout.connect(self.render)

    def show_messages(self, messages: list[RenderedMessage]) -> None:
        self.messages = messages
        self.render(scroll_to_end=True)

    def append_streaming(self, message: RenderedMessage) -> None:
        self.messages.append(message)
        self.render(scroll_to_end=True)

    def add_text(self, delta: str) -> None:
        """Extend the streaming reply; the view catches up on a short timer."""
        if self.messages:
            self.messages[-1].content += delta
            if not self._refresh.isActive():
                self._refresh.start()

    def set_last_state(self, state: str, message_id: int | None = None) -> None:
        if self.messages:
            self.messages[-1].state = state
            if message_id is not None:
                self.messages[-1].id = message_id
            self.render()

    def render(self, scroll_to_end: bool = False) -> None:
        bar = self.verticalScrollBar()
        at_end = scroll_to_end or bar.value() >= bar.maximum() - 4
        position = bar.value()
        for m in self.messages:
            m.show_thinking = m.id in self._thinking_open
        self.setHtml(conversation_html(self.messages))
        bar.setValue(bar.maximum() if at_end else position)

    def _message(self, message_id: int) -> RenderedMessage | None:
        return next((m for m in self.messages if m.id == message_id), None)

    def _on_link(self, url: QUrl) -> None:
        parts = url.toString().split(":")
        if len(parts) < 3 or parts[0] != "action":
            return
        verb, arg = parts[1], int(parts[2])
        message = self._message(arg)
        if verb == "copy-msg" and message:
            QGuiApplication.clipboard().setText(split_thinking(message.content)[1])
        elif verb == "copy-code" and message:
            QGuiApplication.clipboard().setText(code_blocks(message.content)[int(parts[3])])
        elif verb == "think":
            self._thinking_open ^= {arg}
            self.render()
        else:
            self.action.emit(verb, arg)
