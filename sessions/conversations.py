"""Conversations and their messages, with branches and full-text search.

Messages form a tree: each has a parent (NULL for a conversation's first).
Editing a user message or regenerating a reply adds a sibling; the
conversation's `current_message_id` names the leaf of the branch on screen,
and the path from the root to it is what the model sees.

Rows are read defensively (damaged JSON or NULLs become empty values, not
exceptions), and every storage failure in a store method becomes a clear
`UserError` (sessions.errors.guarded).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone

import sqlite_utils

from sessions.db import is_row_id
from sessions.errors import UserError, guarded
from sessions.overrides import ChatOverrides
from sessions.titles import make_title


class NotFound(UserError):
    pass


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


@dataclass
class Message:
    id: int
    conversation_id: int
    parent_id: int | None
    role: str
    content: str
    state: str
    stats: dict
    created: str

    @classmethod
    def from_row(cls, row: dict) -> Message:
        return cls(
            id=row["id"],
            conversation_id=row["conversation_id"],
            parent_id=_id(row["parent_id"]),
            role=row["role"],
            content=_text(row["content"]),
            state=_text(row["state"]) or "complete",
            stats=_json_object(row["stats"]),
            created=_text(row["created"]),
        )


@dataclass
class Conversation:
    id: int
    title: str
    model: str
    system_prompt: str | None
    settings: dict
    current_message_id: int | None
    created: str
    updated: str
    messages: list[Message] = field(default_factory=list)  # the current branch, root first
    overrides: ChatOverrides = field(default_factory=ChatOverrides)  # its own settings

    @classmethod
    def from_row(cls, row: dict) -> Conversation:
        return cls(
            id=row["id"],
            title=_text(row["title"]),
            model=_text(row["model"]),
            system_prompt=row["system_prompt"] if isinstance(row["system_prompt"], str) else None,
            settings=_json_object(row["settings"]),
            current_message_id=_id(row["current_message_id"]),
            created=_text(row["created"]),
            updated=_text(row["updated"]),
            overrides=ChatOverrides.from_row(row),
        )

    def system_for(self, default: str | None) -> str | None:
        """The system prompt a turn uses: the chat's own when it has one, else `default`
        (the preference)."""
        return self.system_prompt or default or None

    def chat_messages(self) -> list[dict]:
        """The branch as the role/content dicts a chat template takes."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


def _text(value: object) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else "" if value is None else str(value)


def _id(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _json_object(value: object) -> dict:
    """A JSON object column; anything else (NULL, damaged text) reads as empty."""
    try:
        parsed = json.loads(value) if isinstance(value, str | bytes) else None
    except (ValueError, RecursionError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


class ConversationStore:
    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db

    # -- conversations ---------------------------------------------------------

    @guarded
    def create(
        self,
        model: str,
        system_prompt: str | None = None,
        settings: dict | None = None,
        title: str = "",
    ) -> Conversation:
        stamp = now()
        table = self.db["conversations"]
        table.insert(
            {
                "title": title,
                "model": model,
                "system_prompt": system_prompt,
                "settings": json.dumps(settings or {}),
                "current_message_id": None,
                "created": stamp,
                "updated": stamp,
            }
        )
        return self.get(table.last_pk)

    @guarded
    def get(self, conversation_id: int) -> Conversation:
        if not is_row_id(conversation_id):
            raise NotFound(f"No conversation {conversation_id}")
        rows = list(self.db["conversations"].rows_where("id = ?", [conversation_id]))
        if not rows:
            raise NotFound(f"No conversation {conversation_id}")
        conversation = Conversation.from_row(rows[0])
        try:
            conversation.messages = self.branch(conversation.current_message_id)
        except NotFound:  # a damaged pointer: show the newest message's branch instead
            newest = self.db.execute(
                "select max(id) from messages where conversation_id = ?", [conversation_id]
            ).fetchone()[0]
            conversation.current_message_id = newest
            conversation.messages = self.branch(newest)
        return conversation

    def exists(self, conversation_id: int) -> bool:
        """Whether the conversation is there (one row read, not the whole list)."""
        return bool(self.db["conversations"].count_where("id = ?", [conversation_id]))

    @guarded
    def list(self) -> list[Conversation]:
        """All conversations, most recently updated first (without their messages)."""
        rows = self.db["conversations"].rows_where(order_by="updated desc, id desc")
        return [Conversation.from_row(r) for r in rows]

    @guarded
    def rename(self, conversation_id: int, title: str) -> None:
        self._update(conversation_id, title=title.strip())

    @guarded
    def update_settings(self, conversation_id: int, **fields) -> None:
        self._update(conversation_id, **fields)

    @guarded
    def set_overrides(self, conversation_id: int, overrides: ChatOverrides) -> None:
        """The chat's own settings, all of them: a field left None goes back to the default."""
        self._update(conversation_id, **overrides.columns())

    @guarded
    def delete(self, conversation_id: int) -> None:
        self.get(conversation_id)
        with self.db.conn:
            self.db["messages"].delete_where("conversation_id = ?", [conversation_id])
            self.db["conversation_caches"].delete_where("conversation_id = ?", [conversation_id])
            self.db["conversations"].delete(conversation_id)

    def _update(self, conversation_id: int, **fields) -> None:
        self.get(conversation_id)
        self.db["conversations"].update(conversation_id, {**fields, "updated": now()})

    # -- messages --------------------------------------------------------------

    @guarded
    def add_message(
        self,
        conversation_id: int,
        role: str,
        content: str,
        parent_id: int | None = None,
        state: str = "complete",
        stats: dict | None = None,
    ) -> Message:
        """Append a message under `parent_id` and make it the current branch's leaf.

        Committed at once: a message exists on disk as soon as it exists.
        """
        conversation = self.get(conversation_id)
        stamp = now()
        with self.db.conn:
            table = self.db["messages"]
            table.insert(
                {
                    "conversation_id": conversation_id,
                    "parent_id": parent_id,
                    "role": role,
                    "content": content,
                    "state": state,
                    "stats": json.dumps(stats or {}),
                    "created": stamp,
                    "updated": stamp,
                }
            )
            message_id = table.last_pk
            changes = {"current_message_id": message_id, "updated": stamp}
            if role == "user" and not conversation.title:
                changes["title"] = make_title(content)
            self.db["conversations"].update(conversation_id, changes)
        return self.message(message_id)

    @guarded
    def newest_message_id(self) -> int:
        """The id of the newest message of any conversation (0: none yet)."""
        return self.db.execute("select coalesce(max(id), 0) from messages").fetchone()[0]

    def user_messages_after(self, conversation_id: int, message_id: int) -> int:
        """How many messages of the user's the conversation got after message `message_id`
        (by id, on any branch)."""
        query = (
            "select count(*) from messages where conversation_id = ? and role = 'user' and id > ?"
        )
        return self.db.execute(query, [conversation_id, message_id]).fetchone()[0]

    def message(self, message_id: int) -> Message:
        if not is_row_id(message_id):
            raise NotFound(f"No message {message_id}")
        rows = list(self.db["messages"].rows_where("id = ?", [message_id]))
        if not rows:
            raise NotFound(f"No message {message_id}")
        return Message.from_row(rows[0])

    @guarded
    def update_message(
        self,
        message_id: int,
        content: str | None = None,
        state: str | None = None,
        stats: dict | None = None,
    ) -> None:
        changes: dict = {"updated": now()}
        if content is not None:
            changes["content"] = content
        if state is not None:
            changes["state"] = state
        if stats is not None:
            changes["stats"] = json.dumps(stats)
        with self.db.conn:
            self.db["messages"].update(message_id, changes)

    @guarded
    def branch(self, leaf_id: int | None) -> list[Message]:
        """The messages from the root down to `leaf_id`.

        A damaged tree still gives a branch: the walk stops at a parent that is
        missing or that it has seen already (a cycle), rather than failing or looping.
        """
        # One query for the whole chain (a query a message cost 0.03 ms each, and a
        # turn or a search asks for branches several times): UNION keeps each id
        # once, so a cycle ends the recursion too.
        rows = self.db.query(
            """with recursive chain(id) as (
                select ? union
                select parent_id from messages join chain using (id)
                where parent_id is not null
            ) select messages.* from messages join chain using (id)""",
            [leaf_id],
        )
        by_id = {row["id"]: Message.from_row(row) for row in rows}
        path: list[Message] = []
        seen: set[int] = set()
        while leaf_id is not None and leaf_id not in seen:
            seen.add(leaf_id)
            if leaf_id not in by_id:
                if not path:
                    raise NotFound(f"No message {leaf_id}")
                break
            path.append(by_id[leaf_id])
            leaf_id = path[-1].parent_id
        return path[::-1]

    @guarded
    def siblings(self, message_id: int) -> list[Message]:
        """The alternatives to a message (itself included), oldest first."""
        message = self.message(message_id)
        where = "conversation_id = ? and parent_id is ?"
        rows = self.db["messages"].rows_where(
            where, [message.conversation_id, message.parent_id], order_by="id"
        )
        return [Message.from_row(r) for r in rows]

    @guarded
    def select_branch(self, conversation_id: int, message_id: int) -> None:
        """Show the branch through `message_id`, down to its newest descendant."""
        leaf = message_id
        while True:
            rows = list(
                self.db["messages"].rows_where("parent_id = ?", [leaf], order_by="id desc", limit=1)
            )
            if not rows:
                break
            leaf = rows[0]["id"]
        self._update(conversation_id, current_message_id=leaf)

    # -- search and export -----------------------------------------------------

    @guarded
    def search(self, text: str, limit: int = 50) -> list[tuple[Conversation, Message]]:
        """Messages whose text matches `text` (all words, any order), newest first."""
        words = [w for w in text.replace('"', " ").split() if w]
        if not words:
            return []
        query = " ".join(f'"{w}"' for w in words)
        sql = (
            "select messages.* from messages join messages_fts "
            "on messages.rowid = messages_fts.rowid where messages_fts match ? "
            "order by messages.id desc limit ?"
        )
        results = []
        for row in self.db.query(sql, [query, limit]):
            message = Message.from_row(row)
            conversation = Conversation.from_row(
                self.db["conversations"].get(message.conversation_id)
            )
            results.append((conversation, message))
        return results

    @guarded
    def export(self, conversation_id: int, fmt: str) -> str:
        conversation = self.get(conversation_id)
        if fmt == "json":
            return json.dumps(
                {
                    "id": conversation.id,
                    "title": conversation.title,
                    "model": conversation.model,
                    "system_prompt": conversation.system_prompt,
                    "settings": conversation.overrides.given(),  # only the chat's own
                    "created": conversation.created,
                    "messages": [
                        {
                            "role": m.role,
                            "content": m.content,
                            "created": m.created,
                            "state": m.state,
                        }
                        for m in conversation.messages
                    ],
                },
                indent=2,
                ensure_ascii=False,
            )
        if fmt == "markdown":
            lines = [
                f"# {conversation.title or 'Untitled'}",
                "",
                f"*Model: {conversation.model}*",
                "",
            ]
            if conversation.system_prompt:
                quoted = conversation.system_prompt.splitlines() or [""]
                lines += [f"> System: {quoted[0]}", *(f"> {line}" for line in quoted[1:]), ""]
            for m in conversation.messages:
                lines += [f"**{m.role.capitalize()}:**", "", _markdown_body(m), ""]
            return "\n".join(lines)
        raise UserError(f"Unknown export format {fmt!r} (use markdown or json)")


_UNFINISHED = {"cancelled": "*(stopped)*", "interrupted": "*(stopped)*", "failed": "*(failed)*"}
# A code fence as CommonMark reads one: up to 3 spaces, then 3 or more ` or ~.
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


def _markdown_body(message: Message) -> str:
    """A message's text as a Markdown export holds it: a code block a stopped reply
    left open is closed (else every later message would read as code), and a reply
    that did not finish says so, as the window does."""
    text = message.content
    fence = _open_fence(text)
    if fence:
        text += f"\n{fence}"
    if message.state in _UNFINISHED:
        text += f"\n\n{_UNFINISHED[message.state]}"
    return text


def _open_fence(text: str) -> str | None:
    """The fence of a code block `text` leaves open, None if none is: an opening fence
    of backticks has no backtick after it; a closing one is of its character, at least
    as long, with nothing after it."""
    fence = None
    for line in text.splitlines():
        found = _FENCE.match(line)
        if found is None:
            continue
        run, rest = found.groups()
        if fence is None:
            if not (run[0] == "`" and "`" in rest):
                fence = run
        elif run[0] == fence[0] and len(run) >= len(fence) and not rest.strip():
            fence = None
    return fence


class ReplyWriter:
    """Commits a streaming reply's first text at once, then at most every `interval`
    seconds, and at the end.

    A process killed mid-reply loses at most the last interval of text; the first words
    are on disk even when the whole reply streams faster than one interval.
    """

    def __init__(self, store: ConversationStore, message_id: int, interval: float = 1.0) -> None:
        self.store = store
        self.message_id = message_id
        self.interval = interval
        self.text = ""
        self._saved_at: float | None = None

    def append(self, delta: str) -> None:
        self.text += delta
        if self._saved_at is None or time.monotonic() - self._saved_at >= self.interval:
            self.store.update_message(self.message_id, content=self.text)
            self._saved_at = time.monotonic()

    def finish(self, state: str, stats: dict | None = None, text: str | None = None) -> None:
        if text is not None:
            self.text = text
        self.store.update_message(self.message_id, content=self.text, state=state, stats=stats)
