"""What the user typed in a chat's message box and has not sent: kept per chat, across
switches between chats and across restarts.

Drafts are the window's own state, in a JSON file of their own next to the database
(`drafts.json` in the data folder), written by the window alone: the database has one
writer, the worker, and a draft must be kept while the worker is busy with a reply,
or already stopped when the window closes. A file that cannot be read is no drafts,
never an error: losing a draft must not keep the app from starting.
"""

from __future__ import annotations

from pathlib import Path

from sessions.jsonfile import read_object, write_atomically

FILE_NAME = "drafts.json"
# Characters kept per draft: far more than any model's context, and a pasted file
# several megabytes long is still not written at every switch.
MAX_DRAFT = 1_000_000


class Drafts:
    """The unsent text of each chat (by conversation id; 0 for a chat not yet started)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._texts = _read(path)  # as read at the start, and kept since

    def get(self, conversation_id: int) -> str:
        return self._texts.get(conversation_id, "")

    def put(self, conversation_id: int, text: str) -> None:
        """Keep `text` as the chat's draft ("" or only spaces: it has none); written at
        once, into what the file holds now (another window's drafts stay)."""
        self._change(lambda texts: _set(texts, conversation_id, text[:MAX_DRAFT]))

    def keep_only(self, conversation_ids: set[int]) -> None:
        """Drop the drafts of chats that are gone (deleted), keeping a new chat's."""

        def prune(texts: dict[int, str]) -> None:
            for i in [i for i in texts if i and i not in conversation_ids]:
                del texts[i]

        self._change(prune)

    def _change(self, change) -> None:
        before = dict(self._texts)
        change(self._texts)
        if self._texts == before:
            return
        on_disk = _read(self.path)
        change(on_disk)
        self._write(on_disk)

    def _write(self, texts: dict[int, str]) -> None:
        """Atomically; a write that fails (a full disk, a read-only folder) keeps the
        drafts in memory."""
        write_atomically(self.path, {str(i): text for i, text in texts.items()})


def _set(texts: dict[int, str], conversation_id: int, text: str) -> None:
    if text.strip():
        texts[conversation_id] = text
    else:
        texts.pop(conversation_id, None)


# The longest conversation id read back: SQLite's row ids are 64-bit.
_ID_DIGITS = 19


def _read(path: Path) -> dict[int, str]:
    """The drafts in `path`; entries of the wrong shape are skipped, a damaged file is none."""
    texts = {}
    for key, text in read_object(path).items():
        if not (key.isascii() and key.isdigit() and len(key) <= _ID_DIGITS):
            continue
        if isinstance(text, str) and text.strip():
            texts[int(key)] = text[:MAX_DRAFT]
    return texts
