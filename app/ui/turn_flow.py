"""Starting a turn from the window: a message sent, a reply made again or continued, a
sent message edited, a branch chosen. What the chat view, the status bar and the context
meter show until the worker answers, then the request (the window's signals, which it
wires to the worker)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Slot

from app.ui.render import RenderedMessage
from app.worker import NEW_CONVERSATION, NO_MODELS

if TYPE_CHECKING:
    from app.ui.main_window import MainWindow


@dataclass(frozen=True)
class Pending:
    """A message sent (or an edit, of message `before`) whose turn is under way, with the
    chat it went to and the newest message saved anywhere when it was asked for."""

    text: str
    conversation_id: int | None
    newest: int
    before: int | None = None


class TurnFlow(QObject):
    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self.window = window
        self.pending: Pending | None = None  # the text of the turn under way

    @Slot(str)
    def send(self, text: str) -> None:
        w = self.window
        if not w.models.names():  # an empty library: nothing could answer
            w.composer.show_draft(text)
            w.status.say(NO_MODELS)
            return
        if w.meter.known_not_to_fit(w.conversation_id, text):
            w.composer.edit.setPlainText(text)  # kept: the meter says why and what to do
            return
        if w.setup.holds(text):  # the chat is being made for its settings: sent once it is
            return
        self.pending = Pending(text, w.conversation_id, w.store.newest_message_id())
        w.chat.append_streaming(RenderedMessage(-1, "user", text))
        self.start(text)
        w.send_requested.emit(w.conversation_id or NEW_CONVERSATION, text)

    @Slot()
    def send_in_new_chat(self) -> None:
        """The draft, too long for this chat, sent as a new chat's first message; what
        was typed for a new chat before waits for the next one."""
        composer, drafts = self.window.composer, self.window.drafts
        text = composer.edit.toPlainText()
        composer.edit.clear()  # it leaves this chat: no draft is kept here
        self.window.show_conversation(None)
        waiting = composer.draft()
        composer.edit.setPlainText(text)
        composer.send()
        drafts.keep_for_a_new_chat(waiting)

    def regenerate(self) -> None:
        w = self.window
        self.pending = None  # no text of the user's in this turn
        last = w.chat.messages[-1] if w.chat.messages else None
        if last is not None and last.role == "assistant":
            w.chat.show_messages(w.chat.messages[:-1])  # drawn again, without it
        self.start("", last.id if last is not None and last.id > 0 else None)
        w.regenerate_requested.emit(w.conversation_id)

    def continue_reply(self, message_id: int) -> None:
        """More of the last reply, streamed into the same bubble."""
        w = self.window
        last = w.chat.messages[-1] if w.chat.messages else None
        if last is None or last.id != message_id:
            return
        self.pending = None
        w.expect_reply()
        last.state, last.cut = "streaming", False
        w.chat.redraw_last(scroll_to_end=True)
        w.status.begin()
        self._count("")
        w.continue_requested.emit(message_id)

    def edit(self, message_id: int) -> None:
        """Rewrite a sent message in the composer (it comes back as `edit_sent`)."""
        self.window.composer.begin_edit(message_id, self.window.store.message(message_id).content)

    @Slot(int, str)
    def edit_sent(self, message_id: int, text: str) -> None:
        w = self.window
        if w.meter.known_not_to_fit(w.conversation_id, text, before=message_id):
            # Still being edited, nothing lost: the meter says why and what to do.
            w.composer.begin_edit(message_id, w.store.message(message_id).content)
            w.composer.edit.setPlainText(text)
            return
        ids = [m.id for m in w.chat.messages]
        self.pending = Pending(text, w.conversation_id, w.store.newest_message_id(), message_id)
        w.chat.show_messages(w.chat.messages[: ids.index(message_id)])
        w.chat.append_streaming(RenderedMessage(-1, "user", text))
        self.start(text, message_id)
        w.edit_requested.emit(message_id, text)

    def start(self, text: str = "", before: int | None = None) -> None:
        """A reply to `text` (in place of message `before`) is coming: show its place."""
        w = self.window
        w.expect_reply()
        w.chat.append_streaming(RenderedMessage(-2, "assistant", "", state="streaming"))
        w.status.begin()
        self._count(text, before)
        if not w.models.ready:
            # The worker answers once the model it is loading is in (requests are queued).
            w.status.say("Waiting for the model to load…")

    def failed(self) -> None:
        """The turn under way failed, and the chat on screen is drawn from what was saved
        (a turn stays on its chat). Its text, if the chat did not keep it, goes back: a
        message into the box, before anything typed since; an edit into the edit it was."""
        pending, self.pending, w = self.pending, None, self.window
        if pending is None or pending.conversation_id not in (None, w.conversation_id):
            return
        cid = w.conversation_id  # a new chat's, once the worker made it
        if cid is not None and w.store.user_messages_after(cid, pending.newest):
            return  # saved (what the view shows may be another branch): the chat has it
        if pending.before is not None:
            w.composer.begin_edit(pending.before, w.store.message(pending.before).content)
            w.composer.edit.setPlainText(pending.text)
            return
        typed = w.composer.edit.toPlainText()
        w.composer.show_draft(f"{pending.text}\n\n{typed}" if typed else pending.text)

    def answered(self) -> None:
        """The turn under way finished: its text is the chat's."""
        self.pending = None

    def _count(self, text: str, before: int | None = None) -> None:
        """Count what the turn sends, before it is sent (the worker answers in order):
        the meter adds the reply to it as it streams."""
        self.window.meter.begin_reply(text, before)
        if self.window.models.ready:
            self.window.count_context(text, before)

    @Slot(str, int)
    def on_chat_action(self, verb: str, message_id: int) -> None:
        """A link under a message: Edit, Regenerate, Continue, a branch arrow."""
        w = self.window
        if w.generating:
            return
        if verb == "regenerate":
            self.regenerate()
        elif verb == "edit":
            self.edit(message_id)
        elif verb == "continue":
            self.continue_reply(message_id)
        elif verb in ("branch-prev", "branch-next"):
            siblings = [s.id for s in w.store.siblings(message_id)]
            step = -1 if verb == "branch-prev" else 1
            at = siblings.index(message_id) + step
            if 0 <= at < len(siblings):  # no link past an end is drawn; none goes round
                w.branch_requested.emit(w.conversation_id, siblings[at])
