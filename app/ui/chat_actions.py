"""What the sidebar's menu (and its shortcuts) does to a chat: rename, export, delete,
and what the window shows once the chat on screen is gone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from PySide6.QtCore import QObject, Slot

from app.ui import asking

if TYPE_CHECKING:
    from app.ui.main_window import MainWindow


class ChatActions(QObject):
    def __init__(self, window: MainWindow) -> None:
        super().__init__(window)
        self.window = window
        self.after_delete: int | None = None  # the chat to show once the one on screen goes

    @Slot(int)
    def rename(self, conversation_id: int) -> None:
        w = self.window
        title = asking.new_title(w, w.store.get(conversation_id).title)
        if title is not None:
            w.rename_requested.emit(conversation_id, title)

    @Slot(int, str)
    def export(self, conversation_id: int, fmt: str) -> None:
        w = self.window
        chosen = asking.export_path(w, w.store.get(conversation_id).title, fmt)
        if chosen is not None:
            path, fmt = chosen
            w.export_requested.emit(conversation_id, fmt, path)

    @Slot(int)
    def delete(self, conversation_id: int) -> None:
        """The chat on screen, deleted, makes way at once for the one listed next to it
        (a review: left on screen until the worker got to the delete, it took a message
        or a system prompt meant for the chat that was going); during its own reply, once
        the reply ends (`leave_deleted_chat`)."""
        w = self.window
        if not asking.confirm_delete(w, w.store.get(conversation_id).title):
            return
        if conversation_id == w.conversation_id:
            after = w.sidebar.neighbour(conversation_id)
            if w.replying:
                self.after_delete = after
            else:
                w.show_conversation(after)
        w.drafts.drop(conversation_id)
        w.delete_requested.emit(conversation_id)

    def leave_deleted_chat(self) -> None:
        """The chat on screen is gone (deleted during its reply, or by another program):
        the one listed next to it, as its delete asked, or else a new chat. What the box
        held comes along where that chat has no draft of its own (a turn sent to the chat
        as it went failed, and gave its text back there)."""
        w = self.window
        after, self.after_delete = self.after_delete, None
        typed = w.composer.draft()
        w.show_conversation(after if after and w.store.exists(after) else None)
        if typed and not w.composer.draft():
            w.composer.show_draft(typed)
