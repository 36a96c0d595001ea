"""Under the composer: how much of the model's context the chat and the draft take, and,
before a message that will not fit, a warning with a way forward. While a reply streams
it counts on: the prompt the turn sends, then each piece of the reply as it comes."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QTimer, Signal, Slot
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

from app.ui.theme import chat_colours

if TYPE_CHECKING:  # the service (and so the engine) is imported on the worker's thread
    from app.service.chat import ContextUse


# From this share of the context on, the meter says the chat is nearly full.
NEARLY_FULL = 0.9


# What the count is, for the label's tooltip: a new user's walk read "0 tokens + 32 in
# the draft" for two words (the chat template and the model's system prompt count too).
METER_TIP = (
    "How much of the model's context (what it can read at once) the chat fills, in "
    "tokens: about three quarters of a word each, with the system prompt and the "
    "chat's own formatting counted too."
)


def meter_text(use: ContextUse) -> str:
    text = f"Context: {use.conversation:,} of {use.limit:,} tokens used"
    if use.draft:
        text += f", {use.conversation + use.draft:,} with your message"
    if nearly_full(use):
        text += ". Nearly full: a long reply may be cut; a new chat has room."
    return text


def nearly_full(use: ContextUse) -> bool:
    return use.fits and use.conversation + use.draft >= NEARLY_FULL * use.limit


# The live count while a reply streams is redrawn at most this often.
LIVE_MS = 250


def live_text(use: ContextUse, pieces: int) -> str:
    """A streamed piece is one token nearly always (a character can take two), hence "≈"."""
    total = use.conversation + use.draft + pieces
    return f"Context: ≈{total:,} of {use.limit:,} tokens used, with the reply so far"


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
        self.label.setToolTip(METER_TIP)
        self.fresh = QPushButton("Send in a new chat")
        self.fresh.setToolTip("Start a new chat with this message; this chat stays as it is")
        self.fresh.hide()
        layout = QHBoxLayout(self)
        layout.setContentsMargins(2, 0, 2, 0)
        layout.addWidget(self.label, 1)
        layout.addWidget(self.fresh)
        self.use: ContextUse | None = None
        self.fresh.clicked.connect(self.new_chat_requested)
        # A reply streaming: the count of what its turn sent, and the pieces since.
        self.replying = False
        self._turn: tuple[str, int | None] = ("", None)  # its text and `before`
        self._prompt: ContextUse | None = None
        self._pieces = 0
        self._redraw = QTimer(self, singleShot=True, interval=LIVE_MS)
        self._redraw.timeout.connect(self._show_live)

    def show_if_current(
        self, use: ContextUse, conversation_id: int | None, draft: str, before: int | None
    ) -> None:
        """Show a count only if it is of the chat and the draft on screen now (`before`:
        the message being edited, whose place the draft takes), or, while a reply
        streams, of the turn's prompt."""
        if self.replying:
            if (use.draft_text, use.before) == self._turn:
                self._prompt = use
                self._show_live()
            return
        if (use.conversation_id, use.draft_text, use.before) == (conversation_id, draft, before):
            self.show_use(use)

    def begin_reply(self, text: str, before: int | None = None) -> None:
        """A turn sends `text` (in place of message `before`): its count comes next."""
        self.replying, self._turn = True, (text, before)
        self._prompt, self._pieces = None, 0
        self.fresh.hide()

    @Slot(str)
    def on_text(self, _text: str) -> None:
        if not self.replying:
            return
        self._pieces += 1
        if not self._redraw.isActive():
            self._redraw.start()

    def end_reply(self) -> None:
        """The reply is done: the exact count (asked for next) replaces the estimate."""
        self.replying = False
        self._redraw.stop()

    @Slot()
    def _show_live(self) -> None:
        if self.replying and self._prompt is not None:
            self.label.setStyleSheet("")
            self.label.setText(live_text(self._prompt, self._pieces))

    def known_not_to_fit(
        self, conversation_id: int | None, text: str, before: int | None = None
    ) -> bool:
        """Whether the last count already says that `text` does not fit this chat (in
        place of message `before`, for an edit)."""
        use = self.use
        counted = use is not None and (use.conversation_id, use.before) == (conversation_id, before)
        return counted and use.draft_text.strip() == text and not use.fits

    def show_use(self, use: ContextUse) -> None:
        self.use = use
        if use.fits:
            self.label.setText(meter_text(use))
            warn = f"color: {chat_colours().warning}" if nearly_full(use) else ""
            self.label.setStyleSheet(warn)
        else:
            self.label.setText(warning_text(use))
            self.label.setStyleSheet(f"color: {chat_colours().warning}")
        alone_fits = use.draft < use.limit
        self.fresh.setVisible(not use.fits and use.conversation_id is not None and alone_fits)

    def clear(self) -> None:
        self.use = None
        self.label.setText("")
        self.fresh.hide()
