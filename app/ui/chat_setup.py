"""A chat's own system prompt and settings, asked for from the header.

A new chat's can be chosen before its first message (a new user's walk wanted a
persona first): the worker makes the chat for them, then the window shows it, if
the user is still on the new chat. A message sent meanwhile waits in the box and
goes once the chat is made; `send` would otherwise make a second chat (a review
found the prompt's chat empty and the message in another, without the prompt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, SignalInstance, Slot

from app.ui import asking
from app.ui.chat_settings import chat_settings
from app.worker import NEW_CONVERSATION
from sessions.overrides import ChatOverrides

if TYPE_CHECKING:
    from app.ui.main_window import MainWindow
    from sessions.conversations import Conversation

MAKING = "Making this chat with its settings: your message goes in a moment"


class ChatSetup(QObject):
    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self.window = window
        self.making = False  # the worker is making the new chat for its settings
        self._send_when_made = False

    @Slot()
    def change_system_prompt(self) -> None:
        w = self.window
        if not self._can_change():
            return
        chat = self._on_screen()
        own = (chat.system_prompt if chat else None) or ""
        text = asking.system_prompt(w, own, w.preferences().system_prompt)
        if self._still_on(chat) and text is not None and (chat is not None or text.strip()):
            self._ask(w.system_prompt_requested, chat, text)

    @Slot()
    def change_chat_settings(self) -> None:
        w = self.window
        if not self._can_change():
            return
        chat = self._on_screen()
        chosen = chat_settings(w, chat.overrides if chat else ChatOverrides(), w.preferences())
        if self._still_on(chat) and chosen is not None and (chat is not None or chosen.given()):
            self._ask(w.chat_settings_requested, chat, chosen)

    def _can_change(self) -> bool:
        """No change while a reply is written, nor to a new chat with no model to make it."""
        w = self.window
        return not w.generating and (w.conversation_id is not None or w.models.ready)

    def _still_on(self, chat: Conversation | None) -> bool:
        """After a dialog: the keyboard back in the message box (it stayed on the header's
        button, so the next word was lost and its space opened the dialog again: a new
        user's walk), and whether the window still shows the chat the dialog was opened
        for. A chat deleted while the dialog was up made way for its neighbour, which got
        the prompt (a review): the change is then dropped, and said so."""
        w = self.window
        w.composer.edit.setFocus()
        if w.conversation_id == (chat.id if chat else None):
            return True
        w.status.say("That chat was deleted meanwhile: nothing was changed")
        return False

    def _on_screen(self) -> Conversation | None:
        w = self.window
        return w.store.get(w.conversation_id) if w.conversation_id else None

    def _ask(self, request: SignalInstance, chat: Conversation | None, value: object) -> None:
        """The worker sets `value` for the chat on screen, making it first if it is new."""
        self.making = chat is None
        request.emit(self.window.conversation_id or NEW_CONVERSATION, value)

    def holds(self, text: str) -> bool:
        """Whether a message sent now waits for the chat being made (kept in the box)."""
        w = self.window
        if not (self.making and w.conversation_id is None):
            return False
        w.composer.show_draft(text)
        self._send_when_made = True
        w.status.say(MAKING)
        return True

    def made(self, for_settings: bool) -> None:
        """The chat was made and is on screen: what waited for it is sent."""
        if for_settings and self._send_when_made and self.window.composer.edit.toPlainText():
            self.window.composer.send()
        self._send_when_made = False

    def left(self) -> None:
        """The user left the new chat: its message stays with its draft."""
        self._send_when_made = False

    def failed(self) -> None:
        """The worker failed: no chat is coming (the message stays in the box)."""
        self.making = self._send_when_made = False
