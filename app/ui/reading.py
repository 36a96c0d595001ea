"""What the window shows, read from the database on its read-only connection:
the sidebar's entries and the messages of the branch on screen."""

from __future__ import annotations

import re

from app.ui.render import RenderedMessage
from app.ui.sidebar import SidebarEntry, snippet
from sessions.cachefiles import CacheIndex
from sessions.conversations import ConversationStore

# Characters no file name may hold on one of the systems the app runs on, and controls.
_NOT_IN_FILE_NAMES = re.compile(r'[\x00-\x1f\x7f/\\:*?"<>|]+')


def export_name(title: str) -> str:
    """A file name made from a chat's title: no path separators, no characters Windows or
    macOS refuse, no leading or trailing dot (a hidden file; "fruits..md", a walk saw),
    at most 80 characters."""
    name = " ".join(_NOT_IN_FILE_NAMES.sub(" ", title).split())[:80].strip(". ")
    return name or "chat"


def sidebar_entries(store: ConversationStore, index: CacheIndex, query: str) -> list[SidebarEntry]:
    """Every conversation, newest first; with a query, those whose text matches it,
    each with the matching snippet. A match on the branch on screen is preferred; one
    only on another branch (a reply made again, an edited question) still finds the
    chat, said to be elsewhere: opening it shows the branch the match is on."""
    caches = {c["conversation_id"]: c for c in index.conversations_summary()}
    if not query:
        return [
            SidebarEntry(c.id, c.title, caches.get(c.id), c.updated, empty=not c.current_message_id)
            for c in store.list()
        ]
    found: dict[int, SidebarEntry] = {}
    shown: dict[int, set[int]] = {}  # each chat's branch on screen
    for c, message in store.search(query):
        if c.id not in shown:
            shown[c.id] = {m.id for m in store.branch(c.current_message_id)}
        elsewhere = message.id not in shown[c.id]
        if c.id in found and (elsewhere or not found[c.id].elsewhere):
            continue  # the chat's newest match on the branch on screen is kept
        text = snippet(message.content, query)
        found[c.id] = SidebarEntry(
            c.id, c.title, caches.get(c.id), c.updated, text, elsewhere, message.id
        )
    return list(found.values())


def rendered_messages(
    store: ConversationStore, conversation_id: int | None
) -> list[RenderedMessage]:
    """The branch on screen, each message with its place among its siblings."""
    if conversation_id is None:
        return []
    messages = store.get(conversation_id).messages
    rendered = []
    for i, m in enumerate(messages):
        siblings = store.siblings(m.id)
        index = [s.id for s in siblings].index(m.id) + 1
        rendered.append(
            RenderedMessage(
                m.id,
                m.role,
                m.content,
                m.state,
                (index, len(siblings)),
                is_last=i == len(messages) - 1,
                cut=m.state == "complete" and m.stats.get("finish_reason") == "length",
            )
        )
    return rendered
