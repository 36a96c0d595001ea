"""Each chat keeps what was typed into its message box and not sent: switching chats
puts that chat's draft in the box, and quitting keeps the one on screen too
(`sessions.drafts` stores them)."""

from __future__ import annotations

from PySide6.QtCore import QObject, Slot

from app.ui.composer import Composer
from app.worker import NEW_CONVERSATION
from sessions import paths
from sessions.drafts import FILE_NAME, Drafts


class DraftKeeper(QObject):
    def __init__(self, composer: Composer, parent: QObject) -> None:
        super().__init__(parent)
        self.composer = composer
        self.drafts = Drafts(paths.data_dir() / FILE_NAME)
        self.showing: int | None = None  # the chat whose draft the composer holds

    def swap(self, conversation_id: int | None) -> None:
        """Keep what was typed for the chat on screen; show what was typed for the next."""
        self.keep()
        self.showing = conversation_id or NEW_CONVERSATION
        self.composer.show_draft(self.drafts.get(self.showing))

    def keep(self) -> None:
        if self.showing is not None:
            self.drafts.put(self.showing, self.composer.draft())

    @Slot(str)
    def forget(self, _text: str = "") -> None:
        """Sent: the chat has no draft now (a message too long to send comes back into
        the box, and is kept as its draft again at the next switch)."""
        if self.showing is not None:
            self.drafts.put(self.showing, "")

    def keep_for_a_new_chat(self, text: str) -> None:
        """`text` waits for the next new chat (the one on screen was given other text)."""
        self.drafts.put(NEW_CONVERSATION, text)

    def prune(self, conversation_ids: set[int]) -> None:
        """Drop the drafts of chats no longer in `conversation_ids` (deleted)."""
        self.drafts.keep_only(conversation_ids)

    def drop(self, conversation_id: int) -> None:
        """A chat being deleted: its draft goes with it (its id may be a new chat's next)."""
        self.drafts.put(conversation_id, "")
        if self.showing == conversation_id:
            self.showing = None  # nothing to keep when the window moves on

    def started(self, conversation_id: int) -> None:
        """The new chat on screen got its id: what is typed now is its draft."""
        self.showing = conversation_id
