"""Where the window was when it last closed: its geometry, the sidebar's width (as Qt
gives them, base64 text) and the chat it showed, kept in `window.json` next to the
database (sessions/window_state.py, the window's own file: written at close, as the
drafts are). A state Qt cannot use, from another screen or a damaged file, is let go."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import QByteArray

from sessions import paths, window_state

if TYPE_CHECKING:
    from app.ui.main_window import MainWindow


def _file() -> Path:
    return paths.data_dir() / window_state.FILE_NAME


def restore(window: MainWindow) -> dict[str, str]:
    """The window put back where it was, the sidebar as wide; the state read."""
    state = window_state.load(_file())
    for name, put_back in (
        ("geometry", window.restoreGeometry),
        ("splitter", window.splitter.restoreState),
    ):
        if name in state:
            put_back(QByteArray.fromBase64(state[name].encode("ascii")))
    return state


def chat_left_open(state: dict[str, str], chats: list[int]) -> int | None:
    """The chat on screen when the window last closed, if it is still there; else the
    first of `chats` (the one most recently written to; found on a new-user walk: a chat
    read, not written to, gave way at the next start to one with newer messages)."""
    left = state.get("conversation", "")
    if left.isdigit() and int(left) in chats:
        return int(left)
    return chats[0] if chats else None


def keep(window: MainWindow) -> None:
    state = {
        "geometry": window.saveGeometry().toBase64().data().decode("ascii"),
        "splitter": window.splitter.saveState().toBase64().data().decode("ascii"),
    }
    if window.conversation_id is not None:
        state["conversation"] = str(window.conversation_id)
    window_state.save(_file(), state)
