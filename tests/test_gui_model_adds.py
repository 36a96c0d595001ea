"""A model added while the window runs (the Models dialog's import or download, first
start's, one that ends after the dialog closed): listed, loaded, its failures said once, and
a message sent meanwhile kept (Qt offscreen)."""

from __future__ import annotations

from gui_window import READY_MS, boxes_said, prefer, wait_reply, wait_streaming, when_a_box_opens
from PySide6.QtCore import QTimer
from test_gui_start import a_model_without_weights

from app.ui.main_window import MainWindow

# Notes which thread first imports each heavy package, then starts the window as `reprise` does.


def test_a_model_whose_import_ends_after_the_dialog_closed_is_listed_and_loaded(
    qtbot, monkeypatch, tmp_path
):
    """Review: the Models dialog, closed while it imported, stayed alive hidden and took
    the news; the window, with no model, never heard of the one that came. New-user walk:
    its status bar said "There is no model yet" all along, then the model was in."""
    import tiny
    from app.ui.menus import open_models
    from app.ui.models_dialog import ModelsDialog

    warned = boxes_said(monkeypatch)
    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    assert not window.models.ready
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")

    def import_and_close(dialog):
        dialog.start_import(str(gguf), "tiny")
        dialog.accept()

    said: list[str] = []
    watch = QTimer(interval=5)  # what the status bar says, as the user would see it
    watch.timeout.connect(
        lambda: said[-1:] != [text := window.status.message.text()] and said.append(text)
    )
    watch.start()
    when_a_box_opens(import_and_close, kind=ModelsDialog)
    open_models(window)
    qtbot.waitUntil(lambda: window.models.ready, timeout=READY_MS)
    assert window.models.names() == ["tiny"] and window.models.current() == "tiny"
    assert warned == []
    watch.stop()
    adding = [text for text in said if text.startswith("Adding the model: ")]
    assert adding and said.index(adding[0]) < said.index("Added tiny"), said
    window.close()


def test_an_import_that_fails_is_said_once_where_it_was_asked(
    qtbot, open_window, monkeypatch, tmp_path
):
    """New-user walk: a failed import was said three times (a box, the Models dialog, the
    status bar). In the dialog while it is up, with the status bar; in a box once the
    dialog is closed, as nothing else would say it."""
    from app.ui.menus import open_models
    from app.ui.models_dialog import ModelsDialog

    warned = boxes_said(monkeypatch)
    window = open_window()
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + bytes(60))
    said_in_dialog = []

    def import_and_read(dialog):
        dialog.start_import(str(damaged), "damaged")
        qtbot.waitUntil(lambda: dialog.progress.isHidden(), timeout=60_000)
        said_in_dialog.append(dialog.message.text())
        dialog.accept()

    when_a_box_opens(import_and_read, kind=ModelsDialog)
    open_models(window)
    assert "damaged.gguf" in said_in_dialog[0]
    assert window.status.message.text() == said_in_dialog[0].splitlines()[0]
    assert warned == []

    def import_and_close(dialog):
        dialog.start_import(str(damaged), "damaged")
        dialog.accept()

    when_a_box_opens(import_and_close, kind=ModelsDialog)
    open_models(window)
    qtbot.waitUntil(lambda: bool(warned), timeout=60_000)
    assert warned == said_in_dialog


def test_a_model_added_when_the_chosen_one_cannot_load_is_the_one_loaded(
    qtbot, monkeypatch, starter_model_dir, tmp_path
):
    """Review: with only a broken model in the library, importing a working one loaded
    the broken one again, twice (three boxes), and never the new one."""
    import tiny
    from app.ui.menus import open_models
    from app.ui.models_dialog import ModelsDialog

    warned = boxes_said(monkeypatch)
    a_model_without_weights(starter_model_dir, "broken")
    window = MainWindow()
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: len(warned) == 1, timeout=READY_MS)
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")

    def import_and_close(dialog):
        dialog.start_import(str(gguf), "tiny")
        qtbot.waitUntil(lambda: dialog.message.text() == "Added tiny", timeout=60_000)
        dialog.accept()

    when_a_box_opens(import_and_close, kind=ModelsDialog)
    open_models(window)
    qtbot.waitUntil(lambda: window.models.ready, timeout=READY_MS)
    assert window.models.current() == "tiny"
    assert len(warned) == 1
    window.close()


def test_a_downloads_folder_that_cannot_be_looked_in_does_not_stop_the_start(monkeypatch):
    """Review: `Path.is_file` raises for a folder the system will not let us read (a
    Mac's Downloads, access denied) or a name too long, before the window existed."""
    from app.ui import first_run

    monkeypatch.setenv("REPRISE_STARTER_GGUF", "/tmp/" + "x" * 300 + ".gguf")
    monkeypatch.setenv("REPRISE_DOWNLOADS_DIR", "/tmp/" + "y" * 300)
    assert first_run.starter_gguf() is None


def download_behind_the_closed_dialog(qtbot, window) -> None:
    """Models… → a download from the (fake) hub, and Close once it is under way."""
    from app.ui.menus import open_models
    from app.ui.models_dialog import ModelsDialog

    def download_and_close(dialog):
        dialog.start_download("mlx-community/tiny")
        qtbot.waitUntil(lambda: "MB" in dialog.message.text(), timeout=60_000)
        dialog.accept()

    when_a_box_opens(download_and_close, kind=ModelsDialog)
    open_models(window)


def test_enter_while_a_model_is_added_says_so_not_that_a_reply_is_written(
    qtbot, open_window, monkeypatch, tiny_model_dir
):
    """Review: during a download left running behind the closed Models dialog, Enter
    said "A reply is being written … (Esc stops it)", and Esc then cancelled the download.
    New-user walk: the message box's button was Stop, and another chat could not be
    opened ("A reply is being written here"), though no reply was."""
    from hub_server import FakeHub

    from app.ui.main_window import HELD_BY_ADD
    from sessions.conversations import ConversationStore
    from sessions.db import open_db

    other = ConversationStore(open_db()).create("SmolLM2-135M-Instruct")
    window = open_window()
    with FakeHub({"mlx-community/tiny": tiny_model_dir}, seconds_per_block=0.05) as hub:
        monkeypatch.setenv("REPRISE_HF_ENDPOINT", hub.endpoint)
        download_behind_the_closed_dialog(qtbot, window)
        assert window.generating  # the worker is busy with the download
        window.composer.edit.setPlainText("Hello?")
        window.composer.edit.submitted.emit()
        assert window.status.message.text() == HELD_BY_ADD
        button = window.composer.button
        assert (button.text(), button.isEnabled()) == ("Send", False)
        window.show_conversation(other.id)  # as a click in the sidebar
        assert window.conversation_id == other.id
        qtbot.waitUntil(lambda: "tiny" in window.models.names(), timeout=60_000)
    assert window.composer.edit.toPlainText() == "Hello?"
    qtbot.waitUntil(lambda: not window.generating, timeout=60_000)
    assert (button.text(), button.isEnabled()) == ("Send", True)


def test_quitting_during_a_download_cancels_it_without_a_box(
    qtbot, open_window, monkeypatch, tiny_model_dir
):
    """The download left running behind the closed Models dialog is cancelled by Quit:
    the window goes, no box stops it, and nothing is kept. The wait said "Saving the
    conversation…" where there was none to save, and the cancelled download's words came
    in a box while quitting (a fresh-clone run caught it)."""
    from hub_server import FakeHub

    from app.ui import quitting

    window = open_window()
    said = boxes_said(monkeypatch)
    waiting_texts: list[str] = []
    monkeypatch.setattr(
        quitting.QProgressDialog, "show", lambda box: waiting_texts.append(box.labelText())
    )
    monkeypatch.setattr(quitting, "PROGRESS_AFTER_MS", 0)
    with FakeHub({"mlx-community/tiny": tiny_model_dir}, seconds_per_block=0.05) as hub:
        monkeypatch.setenv("REPRISE_HF_ENDPOINT", hub.endpoint)
        download_behind_the_closed_dialog(qtbot, window)
        assert window.generating
        window.close()
    assert not window.engine.thread.isRunning()
    qtbot.wait(300)  # what the worker said as it stopped, delivered if the wait had not
    assert said == [] and "Saving the conversation…" not in waiting_texts, (said, waiting_texts)
    assert "tiny" not in window.models.names()


def test_a_reply_asked_for_behind_a_models_import_streams_with_stop(
    qtbot, open_window, monkeypatch, tmp_path
):
    """Review: a message sent while an import waited its turn on the worker (the import
    asked for during a slow moment, the message after) streamed under a greyed-out Send
    that said a model was being added, once the import had ended."""
    import threading

    from PySide6.QtCore import QObject, Signal

    import tiny
    from app.engine import found

    class Asks(QObject):
        find = Signal()
        add = Signal(str, str)

    window = open_window()
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    held = threading.Event()
    monkeypatch.setattr(found, "discover", lambda **_: held.wait(10) and None)
    asks = Asks()
    asks.find.connect(window.engine.worker.find_models)
    asks.add.connect(window.engine.worker.import_gguf)
    asks.find.emit()  # the worker busy a moment (a slow disk), and says nothing of it
    asks.add.emit(str(gguf), "tiny")  # then an import, waiting behind that
    prefer(window, temperature=0.0, max_tokens=2000)
    window.composer.edit.setPlainText("Write a long story about a lighthouse keeper.")
    window.composer.edit.submitted.emit()  # and the message, behind the import
    held.set()
    qtbot.waitUntil(lambda: "tiny" in window.models.names(), timeout=READY_MS)
    wait_streaming(qtbot, window)
    button = window.composer.button
    assert (button.text(), button.isEnabled(), window.replying) == ("Stop", True, True)
    button.click()
    wait_reply(qtbot, window)
    assert window.store.get(window.conversation_id).messages[-1].state == "cancelled"
