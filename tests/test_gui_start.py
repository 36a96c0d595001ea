"""Start-up as a user meets it: the window paints before the engine is imported, and a
message typed while the model loads is answered once it is in."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import STARTER_NAME
from gui_window import READY_MS, boxes_said, prefer, wait_reply, when_a_box_opens
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QMessageBox

from app.ui.main_window import MainWindow
from sessions import paths

# Notes which thread first imports each heavy package, then starts the window as `reprise` does.
SHOWN_WITHOUT_THE_ENGINE = """
import sys, threading, time
HEAVY = ("mlx", "mlx_lm", "transformers")
on_gui_thread = set()

class Note:
    def find_spec(self, name, path=None, target=None):
        if name in HEAVY and threading.current_thread() is threading.main_thread():
            on_gui_thread.add(name)
        return None

sys.meta_path.insert(0, Note())
import app.engine
from PySide6.QtWidgets import QApplication, QMessageBox
app = QApplication(sys.argv)
from app.ui.main_window import MainWindow
# The library is empty: the window warns in a modal box, which would wait for a click.
QMessageBox.warning = lambda *args: None
window = MainWindow()
window.show()
app.processEvents()
print("imported on the GUI thread:", sorted(on_gui_thread))
# Close once the worker has reported (a window closed mid-import is another test's subject).
deadline = time.monotonic() + 240
while window.models.state.text() == "Loading model…" and time.monotonic() < deadline:
    app.processEvents()
    time.sleep(0.05)
window.close()
"""


def test_the_window_thread_never_imports_mlx(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", SHOWN_WITHOUT_THE_ENGINE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "imported on the GUI thread: []" in done.stdout, done.stderr[-2000:]


def test_a_message_typed_while_the_model_loads_is_answered(qtbot, library):
    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    assert window.models.state.text() == "Loading model…"
    prefer(window, temperature=0.0, max_tokens=8)
    window.composer.edit.setPlainText("Hello there")
    window.composer.edit.submitted.emit()
    assert window.status.message.text() == "Waiting for the model to load…"
    wait_reply(qtbot, window)
    assert window.models.ready
    assert [m.role for m in window.chat.messages] == ["user", "assistant"]
    assert window.chat.messages[-1].content
    window.close()


def test_with_no_model_the_window_says_where_to_add_one_and_loses_nothing(
    qtbot, monkeypatch, starter_model_dir
):
    """An empty library (the user chose Later at first start): the status bar names the
    window's own way (File → Models…, not a terminal command) with no box to dismiss; a
    message sent meanwhile stays in the box, no reply waiting under it; once the Models
    dialog has added a model, it loads, and the message is answered."""
    from app.ui.menus import open_models
    from app.ui.models_dialog import ModelsDialog

    warned = boxes_said(monkeypatch)
    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    assert window.models.state.text() == "No model loaded"
    said = window.status.message.text()
    assert "File → Models…" in said and "reprise models" not in said
    # New-user walk: the empty chat said "Start a conversation by typing below."
    assert "Add a model to start chatting" in window.chat.toPlainText()

    window.composer.edit.setPlainText("hello with no model")
    window.composer.edit.submitted.emit()  # Enter
    assert window.composer.edit.toPlainText() == "hello with no model"
    assert window.chat.messages == [] and not window.generating
    assert "File → Models…" in window.status.message.text()

    # What the dialog's import does to the library; then the user closes the dialog.
    (paths.models_dir() / starter_model_dir.name).symlink_to(starter_model_dir)
    when_a_box_opens(lambda box: box.accept(), kind=ModelsDialog)
    open_models(window)
    qtbot.waitUntil(lambda: window.models.ready, timeout=READY_MS)
    assert window.models.state.text() == "Ready"
    assert "File → Models…" not in window.status.message.text()  # no longer true
    window.show_conversation(None)  # (a new chat, empty)
    assert "Start a conversation" in window.chat.toPlainText()
    prefer(window, temperature=0.0, max_tokens=8)
    window.composer.edit.submitted.emit()
    wait_reply(qtbot, window)
    assert [m.content for m in window.chat.messages[:1]] == ["hello with no model"]
    assert warned == []
    window.close()


def test_a_turn_that_loads_the_model_says_so(qtbot, library):
    """No load asked for (the toolbar's came to nothing): the first turn loads the chat's
    model itself, and the worker says which model is in, as for any load."""
    from PySide6.QtCore import QObject, Signal

    from app.worker import NEW_CONVERSATION, WorkerThread

    class Asks(QObject):
        send = Signal(int, str)

    engine = WorkerThread()
    asks = Asks()
    asks.send.connect(engine.worker.send)
    try:
        with qtbot.waitSignal(engine.worker.model_loaded, timeout=READY_MS) as loaded:
            asks.send.emit(NEW_CONVERSATION, "hello")
        assert loaded.args[0] == STARTER_NAME and loaded.args[1]
    finally:
        engine.shutdown()


def test_a_restart_reopens_the_last_chat_and_restores_its_cache(qtbot, library):
    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.models.ready, timeout=READY_MS)
    prefer(window, temperature=0.0, max_tokens=6)
    window.composer.edit.setPlainText("Name a colour.")
    window.composer.edit.submitted.emit()
    wait_reply(qtbot, window)
    chat = window.conversation_id
    qtbot.waitUntil(lambda: window.index.conversation(chat) is not None, timeout=READY_MS)
    window.close()

    again = MainWindow()  # as after quitting and starting the app again
    qtbot.addWidget(again)
    again.show()
    assert again.conversation_id == chat
    assert again.chat.messages[0].content == "Name a colour."
    qtbot.waitUntil(lambda: again.status.message.text().startswith("Ready: "), timeout=READY_MS)
    assert "tokens restored in" in again.status.message.text()
    again.close()


def test_picking_the_model_in_use_again_leaves_it_ready(qtbot, open_window):
    """Review: the toolbar said "Loading model…" for good after the model already in was
    picked again (its load was not answered)."""
    window = open_window()
    picker = window.models.picker
    picker.activated.emit(picker.currentIndex())
    assert window.models.state.text() == "Loading model…"
    qtbot.waitUntil(lambda: window.models.ready, timeout=READY_MS)
    assert window.models.state.text() == "Ready"


def test_a_model_that_fails_to_load_leaves_the_one_before_free_to_go(qtbot, library):
    """Review: the worker's note of the model it had announced held the old model's
    memory while the next one loaded, and for good when that load failed."""
    import gc
    import weakref

    from PySide6.QtCore import QObject, Signal

    from app.worker import WorkerThread

    class Asks(QObject):
        load = Signal(str)

    engine = WorkerThread()
    asks = Asks()
    asks.load.connect(engine.worker.load_model)
    try:
        with qtbot.waitSignal(engine.worker.model_loaded, timeout=READY_MS):
            asks.load.emit(STARTER_NAME)
        before = weakref.ref(engine.worker._service.engine)
        broken = paths.models_dir() / "broken"
        broken.mkdir()
        (broken / "config.json").write_text('{"model_type": "llama"}')
        with qtbot.waitSignal(engine.worker.failed, timeout=READY_MS):
            asks.load.emit("broken")
        gc.collect()
        assert before() is None
    finally:
        engine.shutdown()


def test_while_the_model_loads_a_second_message_waits_and_stop_is_heard(
    qtbot, open_window, monkeypatch
):
    """Review: while a turn waited for the model the box still said Send, so a second
    Enter sent a second turn (texts lost, doubled or in two chats), and a Stop then was
    dropped when the turn began."""
    boxes_said(monkeypatch)
    window = open_window()
    prefer(window, temperature=0.0, max_tokens=400)
    window.model_flow.pick(window.models.current())  # loading again
    window.composer.edit.setPlainText("Write a long story about a lighthouse keeper.")
    window.composer.edit.submitted.emit()
    assert window.composer.button.text() == "Stop"
    window.composer.edit.setPlainText("And another one.")
    window.composer.edit.submitted.emit()  # Enter: not sent, kept
    assert window.composer.edit.toPlainText() == "And another one."
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Escape)  # Stop, still waiting
    wait_reply(qtbot, window)
    stored = window.store.get(window.conversation_id).messages
    assert [m.role for m in stored] == ["user", "assistant"]
    assert stored[-1].state == "cancelled"
    assert window.composer.edit.toPlainText() == "And another one."


def a_model_without_weights(model_dir: Path, name: str) -> None:
    """A library model `model_dir`'s config, and nothing else: it fails to load."""
    (paths.models_dir() / name).mkdir()
    shutil.copy(model_dir / "config.json", paths.models_dir() / name / "config.json")


def test_two_quick_picks_never_say_ready_with_no_model(
    qtbot, open_window, monkeypatch, starter_model_dir
):
    """Review: the first pick's answer, arriving while the second (a broken model)
    loaded, said Ready; the failure then left it so, with no model in, and every count
    of the draft tried the broken one again, a box each time."""
    said = boxes_said(monkeypatch)
    (paths.models_dir() / "Other").symlink_to(starter_model_dir)
    a_model_without_weights(starter_model_dir, "broken")
    window = open_window()
    window.model_flow.refresh()
    window.model_flow.pick("Other")
    window.model_flow.pick("broken")
    qtbot.waitUntil(lambda: bool(said), timeout=READY_MS)
    qtbot.wait(500)  # the first pick's answer has come too
    assert not window.models.ready and window.models.state.text() == "No model loaded"
    window.composer.edit.setPlainText("a draft, counted after a pause")
    qtbot.wait(1500)
    assert len(said) == 1


@pytest.mark.parametrize("load_seconds", [0, 1.0])  # the box is read for 0.5 s
def test_a_message_sent_while_a_broken_model_loads_gets_one_box_and_is_kept(
    qtbot, open_window, monkeypatch, starter_model_dir, load_seconds
):
    """New-user walk: a message sent while a model that cannot load was loading showed
    two boxes, the load's and then the turn's, saying the same; and (review) so it
    still did where the load takes longer than the box is read."""
    from app.service.chat import ChatService

    load = ChatService.load_model

    def slow_load(service, name=None):
        time.sleep(load_seconds)
        return load(service, name)

    monkeypatch.setattr(ChatService, "load_model", slow_load)
    said = []

    def read_for_a_second(parent, title, text):  # modal, as a real box: events go on
        said.append(text)
        qtbot.wait(500)

    monkeypatch.setattr(QMessageBox, "warning", read_for_a_second)
    a_model_without_weights(starter_model_dir, "broken")
    window = open_window()
    window.model_flow.refresh()
    window.model_flow.pick("broken")
    window.composer.edit.setPlainText("Name a colour.")
    window.composer.edit.submitted.emit()
    answered = lambda: bool(said) and window.composer.button.text() == "Send"  # noqa: E731
    qtbot.waitUntil(answered, timeout=READY_MS)
    qtbot.wait(1000)  # whatever else the worker says has come
    assert len(said) == 1, said
    assert window.composer.edit.toPlainText() == "Name a colour."


def test_a_message_sent_later_to_a_model_that_failed_gets_its_box(
    qtbot, monkeypatch, starter_model_dir
):
    """Review: the one-box rule hid the failure of a message sent long after the load
    had failed: only a turn asked for while that load was under way is spared its box."""
    warned = boxes_said(monkeypatch)
    a_model_without_weights(starter_model_dir, "broken")
    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: len(warned) == 1 and not window.models.awaited, timeout=READY_MS)
    window.composer.edit.setPlainText("Hello?")
    window.composer.edit.submitted.emit()
    qtbot.waitUntil(lambda: len(warned) == 2, timeout=READY_MS)
    assert warned[1] == warned[0] and window.composer.edit.toPlainText() == "Hello?"
    window.close()


def test_first_start_offers_the_starter_over_the_window_which_then_loads_it(
    qtbot, starter_gguf, monkeypatch
):
    """A new user's walk: the welcome dialog sat alone on an empty screen, the window
    coming only after the import. Now the window is there behind it, and loads the
    model the dialog added."""
    from app.ui import first_run

    monkeypatch.setenv("REPRISE_STARTER_GGUF", str(starter_gguf))
    assert first_run.needs_first_run()
    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    seen = []

    def import_it(dialog) -> None:
        seen.append((window.isVisible(), dialog.parent() is window))
        QTimer.singleShot(100, dialog.import_starter)

    assert first_run.welcome(window, import_it) == STARTER_NAME
    assert seen == [(True, True)]
    qtbot.waitUntil(lambda: window.models.ready, timeout=READY_MS)
    assert window.models.current() == STARTER_NAME
