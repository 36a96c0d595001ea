"""One writer per conversation at a time, across processes.

Two Reprise processes (a window and a terminal, or two windows) appending to
one conversation would each generate a reply from the history it read, not
the one stored. A turn therefore holds `conversation_lock(id)` from reading the
history to storing the reply; a second process gets a clear `UserError` at
once instead of waiting.

The lock is an advisory `flock` on a small file per conversation in the data
folder: the kernel releases it when its holder exits, however it exits (kill -9
included), so a lock can never be left stale. The file holds the holder's pid,
only to name it in the message.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from sessions import paths
from sessions.errors import UserError, storage_errors

LOCK_FOLDER = "locks"


class ConversationBusy(UserError):
    """Another process is writing to this conversation."""

    def __init__(self, conversation_id: int, pid: int | None) -> None:
        holder = f" (pid {pid})" if pid else ""
        super().__init__(
            f"Conversation {conversation_id} is open in another Reprise window or terminal"
            f"{holder}, which is writing to it. Wait for its reply to finish, or close it there."
        )
        self.conversation_id = conversation_id
        self.pid = pid


def lock_path(conversation_id: int, data_dir: Path | None = None) -> Path:
    return (
        (data_dir or paths.data_dir()) / LOCK_FOLDER / f"conversation-{int(conversation_id)}.lock"
    )


class HeldLock:
    """A conversation's writer lock, held for the length of a `with` block."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def discard(self) -> None:
        """For a conversation being deleted: its lock file goes now, the lock itself at
        the end of the block. A writer that had the file open already finds it gone once
        it holds it, and locks the name's new file instead (`_locked_file`): a chat given
        the id again has one writer at a time too. A file that cannot go is left: it is
        harmless, and the deletion itself is done."""
        with contextlib.suppress(OSError):
            self.path.unlink()


@contextlib.contextmanager
def conversation_lock(conversation_id: int, data_dir: Path | None = None) -> Iterator[HeldLock]:
    """Hold the conversation's writer lock for the block, or raise `ConversationBusy`.

    The lock is per open file, so it also keeps out a second writer in this process.
    """
    path = lock_path(conversation_id, data_dir)
    fd = _locked_file(conversation_id, path)
    try:
        with storage_errors(path):
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield HeldLock(path)
    finally:
        os.close(fd)  # releases the lock


def _locked_file(conversation_id: int, path: Path) -> int:
    """The lock file, open and locked by us. A file locked just as its chat's deletion
    removed it is the name's no longer (a review: with ids used again, a writer of the
    next chat given that id and one holding the removed file both held "the" lock):
    it is let go, and the name's file locked instead."""
    with storage_errors():
        path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        with storage_errors(path):
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = _holder(fd)
            os.close(fd)
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            raise ConversationBusy(conversation_id, holder) from None
        if _is_named(fd, path):
            return fd
        os.close(fd)


def _is_named(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path`."""
    try:
        named, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino)


def is_locked(conversation_id: int, data_dir: Path | None = None) -> bool:
    """Whether some process holds the conversation's writer lock now."""
    try:
        with conversation_lock(conversation_id, data_dir):
            return False
    except ConversationBusy:
        return True


def _holder(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
