"""Above the chat: the model and the settings this chat runs with, in plain words,
and the ways to change them. When the chat was made with another model than the one
loaded, it says so and offers both ways forward."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QGridLayout, QHBoxLayout, QLabel, QPushButton, QWidget

from app.service.preferences import Preferences
from app.ui.chat_settings import differences
from sessions.conversations import Conversation

PREVIEW = 80  # characters of the system prompt shown


def header_text(
    model: str, own_prompt: str | None, default_prompt: str, changed: list[str] = ()
) -> str:
    """One line: the model, what the chat changes from the defaults, and the system
    prompt with where it comes from."""
    if own_prompt:
        prompt = f"System prompt (this chat): “{_preview(own_prompt)}”"
    elif default_prompt:
        prompt = f"System prompt (default): “{_preview(default_prompt)}”"
    else:
        prompt = "System prompt: the model's own"  # its chat template may add one
    return " · ".join([*([model] if model else []), *changed, prompt])


def model_notice(own: str, loaded: str, installed: list[str]) -> str:
    """What to say when the chat's model is not the one loaded ("" when it is)."""
    if not own or own == loaded:
        return ""
    if own not in installed:
        return (
            f"This chat was made with {own}, which is no longer installed. "
            f"It continues with {loaded}."
        )
    return f"This chat was made with {own}; {loaded} is loaded now."


def _preview(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= PREVIEW else line[: PREVIEW - 1] + "…"


class ChatHeader(QWidget):
    system_prompt_requested = Signal()  # the user wants to change this chat's prompt
    settings_requested = Signal()  # ... this chat's sampling and KV settings
    switch_requested = Signal(str)  # load the chat's own model
    keep_requested = Signal(str)  # go on with the model loaded: it becomes the chat's

    def __init__(self) -> None:
        super().__init__()
        self.label = QLabel("")
        self.label.setTextFormat(Qt.TextFormat.PlainText)  # the prompt is the user's text
        self.label.setWordWrap(True)
        self.edit = QPushButton("System prompt…")
        self.edit.setToolTip(
            "Give this chat its own system prompt; leave it empty to use the default "
            "from Preferences"
        )
        self.settings = QPushButton("Chat settings…")
        self.settings.setToolTip(
            "This chat's own temperature, reply length and memory saving; "
            "the rest follows Preferences"
        )
        self.notice = QLabel("")
        self.notice.setTextFormat(Qt.TextFormat.PlainText)  # model names are file names
        self.notice.setWordWrap(True)
        self.switch = QPushButton("")
        self.keep = QPushButton("")
        layout = QGridLayout(self)
        layout.setContentsMargins(4, 0, 4, 0)
        layout.addWidget(self.label, 0, 0)
        layout.addLayout(_row(self.edit, self.settings), 0, 1)
        layout.addWidget(self.notice, 1, 0)
        layout.addLayout(_row(self.switch, self.keep), 1, 1)
        layout.setColumnStretch(0, 1)
        self.edit.clicked.connect(self.system_prompt_requested)
        self.settings.clicked.connect(self.settings_requested)
        self.switch.clicked.connect(lambda: self.switch_requested.emit(self._own))
        self.keep.clicked.connect(lambda: self.keep_requested.emit(self._loaded))
        self._own = self._loaded = ""
        self._show_notice("")

    def show(
        self,
        chat: Conversation | None,
        model: str,
        prefs: Preferences,
        installed: list[str] | None = None,
        ready: bool = True,
    ) -> None:
        """The chat on screen; None: a chat not started yet, which runs with the defaults
        (its own settings, set before its first message, make it, with the model loaded:
        so not while none is). `model` is the one loaded (or loading: `ready` False),
        `installed` every model in the library."""
        own = chat.system_prompt if chat is not None else None
        changed = differences(chat.overrides, prefs) if chat is not None else []
        self.label.setText(header_text(model, own, prefs.system_prompt, changed))
        self.label.setToolTip(own or prefs.system_prompt)
        self.edit.setEnabled(chat is not None or ready)
        self.settings.setEnabled(chat is not None or ready)
        self._own, self._loaded = (chat.model if chat else ""), model
        names = installed if installed is not None else [model]
        self._show_notice(model_notice(self._own, model, names) if ready else "")
        self.switch.setVisible(bool(self.notice.text()) and self._own in names)
        self.switch.setText(f"Switch to {self._own}")
        self.switch.setToolTip(f"Load {self._own} (the model this chat was made with)")
        self.keep.setText(f"Continue with {model}")
        self.keep.setToolTip(f"Go on with {model}; it becomes this chat's model")

    def _show_notice(self, text: str) -> None:
        self.notice.setText(text)
        for widget in (self.notice, self.switch, self.keep):
            widget.setVisible(bool(text))


def _row(*buttons: QPushButton) -> QHBoxLayout:
    row = QHBoxLayout()
    for button in buttons:
        row.addWidget(button)
    return row
