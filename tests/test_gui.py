"""The window, driven as a user would, on the real starter model (Qt offscreen)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
from gui_window import (
    READY_MS,
    prefer,
    send,
    start_long_reply,
    wait_reply,
    wait_streaming,
)
from PySide6.QtCore import QByteArray, QMimeData, Qt, QTimer
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QListWidget,
    QMessageBox,
    QProgressBar,
    QTextEdit,
    QWidget,
)

from app.ui.chat_view import ChatView
from app.ui.main_window import MainWindow
from app.ui.model_flow import ModelFlow
from app.ui.turn_status import TurnStatus


def test_send_streams_a_reply_and_stores_it(qtbot, open_window):
    window = open_window()
    assert not window.models.loading_action.isVisible()  # the loading bar went when ready
    # Plain words on the bar; how the model runs is there for who asks (the tooltip).
    assert window.models.state.text() == "Ready"
    assert window.models.state.toolTip().startswith("Running on cpu")
    deltas = []
    window.engine.worker.text_delta.connect(deltas.append)
    send(qtbot, window, "What is the capital of France?")
    assert len(deltas) > 1
    assert "Paris" in window.chat.toPlainText()
    roles = [m.role for m in window.chat.messages]
    assert roles == ["user", "assistant"]
    assert window.sidebar.list.count() == 1
    assert "tok/s" in window.status.stats.text()


def test_stop_ends_the_reply_early(qtbot, open_window):
    window = open_window()
    start_long_reply(qtbot, window)
    assert window.composer.button.text() == "Stop"
    window.composer.button.click()
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)
    last = window.store.get(window.conversation_id).messages[-1]
    assert last.state == "cancelled"
    assert last.stats["generated_tokens"] < 2000
    assert window.composer.button.text() == "Send"


def test_a_click_on_another_chat_while_replying_is_explained_until_the_reply_ends(
    qtbot, open_window
):
    """Found on a new-user walk: "A reply is being written here: stop it (Esc) to switch
    chats" stayed in the status bar after the reply had ended."""
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    first = window.conversation_id
    window.new_chat()
    prefer(window, temperature=0.0, max_tokens=48)
    window.composer.edit.setPlainText("Write a story about a lighthouse keeper.")
    window.composer.edit.submitted.emit()
    wait_streaming(qtbot, window, chars=5)
    assert window.models.state.text() == "Writing a reply…"  # a walk: it said "Ready"
    window.sidebar.conversation_selected.emit(first)
    assert window.status.message.text().startswith("A reply is being written here")
    assert window.conversation_id != first  # the reply's chat stays on screen
    wait_reply(qtbot, window)  # it ends by itself
    assert not window.status.message.text().startswith("A reply is being written here")
    assert window.models.state.text() == "Ready"


def test_after_a_click_on_stop_the_message_box_has_the_keyboard(qtbot, open_window):
    window = open_window()
    window.activateWindow()
    start_long_reply(qtbot, window)
    qtbot.mouseClick(window.composer.button, Qt.MouseButton.LeftButton)  # Stop
    qtbot.waitUntil(lambda: not window.generating, timeout=READY_MS)
    qtbot.waitUntil(lambda: QApplication.focusWidget() is window.composer.edit, timeout=2_000)


def test_regenerate_and_edit_make_branches(qtbot, open_window, monkeypatch):
    window = open_window()
    send(qtbot, window, "Name a colour.")
    first_reply = window.chat.messages[-1].id
    prefer(window, temperature=1.0)
    window.turns.on_chat_action("regenerate", 0)
    # While the new reply streams, the question shows once (the old reply's place redrawn).
    assert window.chat.toPlainText().count("Name a colour.") == 1
    wait_reply(qtbot, window)
    assert window.chat.messages[-1].branch == (2, 2)
    assert "2/2" in window.chat.toPlainText()
    window.turns.on_chat_action("branch-prev", window.chat.messages[-1].id)
    qtbot.waitUntil(lambda: window.chat.messages[-1].id == first_reply, timeout=5_000)

    user = window.chat.messages[0].id
    # Edit puts the message in the composer, in place of the draft the user was typing.
    window.composer.edit.setPlainText("a draft")
    window.turns.on_chat_action("edit", user)
    assert window.composer.edit.toPlainText() == "Name a colour."
    assert window.composer.banner.isVisibleTo(window) and window.composer.button.text() == "Send"
    window.composer.edit.setPlainText("Name a fruit.")
    window.composer.edit.submitted.emit()  # what Enter does
    streaming = window.chat.toPlainText()
    assert "Name a colour." not in streaming and streaming.count("Name a fruit.") == 1
    wait_reply(qtbot, window)
    assert window.chat.messages[0].content == "Name a fruit."
    assert window.chat.messages[0].branch == (2, 2)
    assert window.composer.edit.toPlainText() == "a draft"  # the draft is back
    assert not window.composer.banner.isVisibleTo(window)


def test_esc_leaves_an_edit_and_gives_the_draft_back(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Name a colour.", greedy_tokens=4)
    window.composer.edit.setPlainText("half a thought")
    window.turns.on_chat_action("edit", window.chat.messages[0].id)
    # The message being edited is marked in the chat (a new user's walk could not tell).
    marked = "Being edited in the message box below"
    assert window.chat.toPlainText().count(marked) == 1
    assert window.chat.toPlainText().index(marked) < window.chat.toPlainText().index("Name a")
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)
    assert marked not in window.chat.toPlainText()
    assert window.composer.edit.toPlainText() == "half a thought"
    qtbot.keyClicks(window.composer.edit, ", finished")  # the cursor waits at its end
    assert window.composer.edit.toPlainText() == "half a thought, finished"
    assert window.composer.editing is None and window.composer.button.text() == "Send"
    assert len(window.store.get(window.conversation_id).messages) == 2  # nothing was sent


def test_a_newer_selection_skips_the_restore_of_the_one_before(qtbot, open_window):
    window = open_window()
    prefetched = []
    window.engine.worker.prefetched.connect(lambda cid, info: prefetched.append(cid))
    window.engine.worker.select(2)
    window.engine.worker.prefetch(1)  # queued before the user moved on to chat 2
    qtbot.wait(200)
    assert prefetched == []


def test_search_filters_the_conversation_list(qtbot, open_window):
    window = open_window()
    send(qtbot, window, "Tell me about penguins.", greedy_tokens=8)
    window.new_chat()
    send(qtbot, window, "Tell me about volcanoes.", greedy_tokens=8)
    assert window.sidebar.list.count() == 2
    window.sidebar.search.setText("penguins")
    assert window.sidebar.list.count() == 1
    assert window.sidebar.list.item(0).text().startswith("Tell me about penguins.")
    window.sidebar.search.clear()
    assert window.sidebar.list.count() == 2


def test_the_window_cannot_write_the_database(qtbot, open_window):
    """Its connection is read-only: every change goes through the worker."""
    from sessions.errors import ReadOnlyStorage

    window = open_window()
    with pytest.raises(ReadOnlyStorage, match="cannot be written"):
        window.store.create("any model")


def test_the_event_loop_stays_responsive_during_a_reply(qtbot, open_window, capsys):
    window = open_window()
    ticks = []
    timer = QTimer(interval=10)
    timer.timeout.connect(lambda: ticks.append(time.perf_counter()))
    timer.start()
    send(qtbot, window, "Describe a forest in a few sentences.", greedy_tokens=60)
    timer.stop()
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert len(ticks) > 10
    with capsys.disabled():
        print(
            f"\nlargest event-loop gap during a reply: {max(gaps) * 1000:.0f} ms "
            f"over {len(ticks)} ticks"
        )


def test_closing_during_a_reply_stops_it_and_saves(qtbot, open_window):
    from sessions.cachefiles import CacheIndex

    window = open_window()
    start_long_reply(qtbot, window)
    conversation = window.conversation_id
    window.close()
    assert window.engine.thread.isFinished()
    reply = window.store.get(conversation).messages[-1]
    assert reply.state == "cancelled" and reply.content
    entry = CacheIndex(window.db).conversation(conversation)
    assert entry is not None and len(entry.tokens) > 20


HANDLERS = {  # every handler of a worker signal, by the class that has it
    MainWindow: {
        "on_conversation_started",
        "on_restored",
        "on_finished",
        "on_saved",
        "on_preferences_saved",
        "on_changed",
        "on_failed",
        "on_busy",
        "on_context_counted",
    },
    ModelFlow: {"on_loaded", "on_added", "on_import_progress", "on_download_progress"},
    ChatView: {"add_text"},
    TurnStatus: {"on_first_text", "on_text", "on_prompt_progress"},
}
# What the handlers change on screen, patched to note the thread that changes it.
WIDGET_CHANGES = [
    (QLabel, "setText"),
    (QTextEdit, "setHtml"),
    (QListWidget, "addItem"),
    (QProgressBar, "setRange"),
    (QProgressBar, "setValue"),
    (QWidget, "setVisible"),
    (QWidget, "show"),
    (QWidget, "hide"),
]


def slot_names(obj) -> set[str]:
    meta = obj.metaObject()
    return {bytes(meta.method(i).name()).decode() for i in range(meta.methodCount())}


def test_every_worker_signal_is_handled_on_the_gui_thread(qtbot, open_window, monkeypatch):
    """Each handler is a slot of a GUI object, so Qt queues each call to the GUI
    thread, whatever thread emits: no widget is ever changed from the worker's."""
    window = open_window()
    for cls, names in HANDLERS.items():
        shown = (window, window.model_flow, window.chat, window.status)
        obj = next(o for o in shown if type(o) is cls)
        assert names <= slot_names(obj), names - slot_names(obj)

    threads: dict[str, set[int]] = {}

    def noting(cls, name):
        original = getattr(cls, name)

        def change(self, *args):
            threads.setdefault(f"{cls.__name__}.{name}", set()).add(threading.get_ident())
            return original(self, *args)

        return change

    for cls, name in WIDGET_CHANGES:
        monkeypatch.setattr(cls, name, noting(cls, name))
    send(qtbot, window, "Hello!", greedy_tokens=8)
    window.rename_requested.emit(window.conversation_id, "Greetings")
    qtbot.waitUntil(
        lambda: window.sidebar.list.item(0).text().startswith("Greetings"), timeout=5_000
    )
    window.edit_requested.emit(10_000, "no such message")  # fails: the user is told
    monkeypatch.setattr(QMessageBox, "warning", lambda *args: None)
    qtbot.waitUntil(lambda: "No message" in window.status.message.text(), timeout=5_000)
    assert {"QLabel.setText", "QTextEdit.setHtml", "QListWidget.addItem"} <= set(threads)
    assert set().union(*threads.values()) == {threading.main_thread().ident}


def test_the_terminal_replies_as_the_window_does(qtbot, open_window):
    """Same saved preferences, same message: `reprise chat` gives the window's reply."""
    from test_cli import reprise

    window = open_window()
    send(qtbot, window, "Name three rivers.", greedy_tokens=24)
    in_window = window.store.get(window.conversation_id).messages[-1].content
    done = reprise("chat", "--conversation", "new", "--json", "Name three rivers.")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["reply"] == in_window


def test_pasted_bytes_that_are_not_utf8_are_sent_and_stored_as_replacement_marks(
    qtbot, open_window
):
    """A paste from a program that put Latin-1 on the clipboard as text/plain: the bad
    bytes arrive as U+FFFD, the message is sent and stored, the reply comes."""
    window = open_window()
    pasted = QMimeData()
    pasted.setData("text/plain", QByteArray(b"caf\xe9 \xff\xfe, what is 2+2?"))
    window.composer.edit.insertFromMimeData(pasted)
    prefer(window, temperature=0.0, max_tokens=8)
    window.composer.edit.submitted.emit()
    wait_reply(qtbot, window)
    stored = window.store.get(window.conversation_id).messages
    assert stored[0].content == "caf\ufffd \ufffd\ufffd, what is 2+2?"
    assert stored[1].role == "assistant" and stored[1].state == "complete"
