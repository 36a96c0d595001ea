"""The window's test support, shared by the GUI test files: its fixtures (`library`,
`open_window`, given to every test by conftest's `pytest_plugins`) and the user's
actions on it (send, stop, wait)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication, QMessageBox

from app.ui.main_window import MainWindow
from sessions import paths

READY_MS = 120_000


@pytest.fixture
def library(starter_model_dir):
    (paths.models_dir() / starter_model_dir.name).symlink_to(starter_model_dir)


@pytest.fixture
def open_window(qtbot, library):
    windows = []

    def start() -> MainWindow:
        window = MainWindow()
        qtbot.addWidget(window)
        window.show()
        qtbot.waitUntil(lambda: window.models.ready, timeout=READY_MS)
        windows.append(window)
        return window

    yield start
    for window in windows:
        window.close()


def prefer(window, **changes):
    """Change preferences the way the window does: a request the worker saves."""
    window.ask_to_save(replace(window.preferences(), **changes))


def send(qtbot, window, text, greedy_tokens=16):
    prefer(window, temperature=0.0, max_tokens=greedy_tokens)
    window.composer.edit.setPlainText(text)
    window.composer.edit.submitted.emit()  # what Enter does
    wait_reply(qtbot, window)


def start_long_reply(qtbot, window):
    """Ask for a long story and wait until it is streaming."""
    prefer(window, temperature=0.0, max_tokens=2000)  # greedy: the same long story each run
    window.composer.edit.setPlainText("Write a long story about a lighthouse keeper.")
    window.composer.edit.submitted.emit()
    wait_streaming(qtbot, window)


def wait_streaming(qtbot, window, chars: int = 20):
    """Until the reply just asked for has `chars` characters on screen; one that never
    started, or ended before, fails at once, saying what is there."""
    reply = window.chat.messages[-1] if window.chat.messages else None
    assert reply is not None and reply.role == "assistant" and reply.id < 0, (
        f"no reply started; the last message: {reply}"
    )
    # Once the turn is over the view shows the stored messages, without `reply`.
    over = lambda: window.chat.messages[-1] is not reply and not window.generating  # noqa: E731
    qtbot.waitUntil(lambda: len(reply.content) > chars or over(), timeout=READY_MS)
    last = window.chat.messages[-1]
    assert len(reply.content) > chars, f"the reply ended: {last.role} {last.state} {last.content!r}"


def boxes_said(monkeypatch) -> list[str]:
    """What the window's warning boxes said, each answered at once (they are modal)."""
    said: list[str] = []
    monkeypatch.setattr(QMessageBox, "warning", lambda parent, title, text: said.append(text))
    return said


def when_a_box_opens(act, title: str | None = None, kind: type | None = None) -> None:
    """Once a modal box (titled `title`, of class `kind`, if given) is up and ready,
    `act(box)`. Another box is left alone: conftest's watchdog closes it and fails
    the test with its text."""
    deadline = time.monotonic() + 60  # not on into later tests

    def look() -> None:
        box = QApplication.activeModalWidget()
        named = _ready(box) and (title is None or box.windowTitle() == title)
        if not (named and (kind is None or isinstance(box, kind))):
            if time.monotonic() < deadline:
                QTimer.singleShot(50, look)
            return
        act(box)

    QTimer.singleShot(50, look)


def _ready(box) -> bool:
    """Shown, its default button too: a box looked at while still being shown (a
    timer can fire inside its show) ignores Enter, and would wait for good."""
    if box is None or not box.isVisible():
        return False
    default = box.defaultButton() if isinstance(box, QMessageBox) else None
    return default is None or default.isVisible()


def wait_reply(qtbot, window):
    """Until the reply is finished and the view shows the stored messages."""
    qtbot.waitUntil(
        lambda: not window.generating and window.chat.messages[-1].id > 0, timeout=READY_MS
    )
