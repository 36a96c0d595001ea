"""The Models dialog: download from a (stand-in) hub with progress and cancel; GGUF import;
models other tools keep on this computer, imported or used in place."""

from __future__ import annotations

import shutil

import pytest
from gui_window import when_a_box_opens
from hub_server import FakeHub
from PySide6.QtCore import QObject, QTimer, Signal
from PySide6.QtWidgets import QLineEdit
from tool_folders import hf_tree, ollama_tree

import tiny
from app.engine.models import list_models
from app.service.preferences import Preferences
from app.ui.models_dialog import ModelsDialog
from app.worker import WorkerThread
from sessions import paths


@pytest.fixture
def dialog(qtbot):
    engine = WorkerThread()
    window = ModelsDialog(engine.worker)
    qtbot.addWidget(window)
    yield window
    engine.shutdown()


@pytest.fixture
def repo(tiny_model_dir, tmp_path):
    folder = tmp_path / "repo"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def names() -> list[str]:
    return [m.name for m in list_models(paths.models_dir())]


def test_download_shows_progress_and_lists_the_model(qtbot, dialog, repo, monkeypatch):
    with FakeHub({"mlx-community/tiny": repo}, seconds_per_block=0.002) as hub:
        monkeypatch.setenv("REPRISE_HF_ENDPOINT", hub.endpoint)
        values = []
        dialog.progress.valueChanged.connect(values.append)
        dialog.start_download("mlx-community/tiny")
        assert not dialog.cancel_button.isHidden()
        qtbot.waitUntil(lambda: dialog.message.text() == "Added tiny", timeout=60_000)
    assert names() == ["tiny"]
    assert dialog.table.topLevelItemCount() == 1
    assert len(set(values)) > 1  # the bar moved


def test_progress_of_a_model_past_2_gb_is_shown_as_it_is(qtbot):
    """A review: the worker's progress signal carried Qt's 32-bit ints, so 5 GB done
    arrived as 705 MB, and past 2.1 GB as negative. Emitted on the worker's thread, as
    the download does."""
    engine = WorkerThread()
    dialog = ModelsDialog(engine.worker)
    qtbot.addWidget(dialog)
    emit = lambda: engine.worker.download_progress.emit(  # noqa: E731
        5_000_000_000, 8_000_000_000, "model-00001-of-00002.safetensors"
    )
    try:
        QTimer.singleShot(0, engine.worker, emit)  # run on the worker's thread
        qtbot.waitUntil(lambda: "MB" in dialog.message.text(), timeout=5_000)
    finally:
        engine.shutdown()
    assert dialog.message.text().endswith("5000.0 of 8000.0 MB")
    assert dialog.progress.value() * 8 == dialog.progress.maximum() * 5


def test_cancel_stops_the_download_and_keeps_nothing(qtbot, dialog, repo, monkeypatch):
    with FakeHub({"mlx-community/tiny": repo}, seconds_per_block=0.05) as hub:
        monkeypatch.setenv("REPRISE_HF_ENDPOINT", hub.endpoint)
        dialog.start_download("mlx-community/tiny")
        qtbot.waitUntil(lambda: "MB" in dialog.message.text(), timeout=60_000)
        dialog.cancel_button.click()
        said = "The download was cancelled; nothing was kept."
        qtbot.waitUntil(lambda: dialog.message.text() == said, timeout=60_000)
    assert names() == []
    assert list(paths.models_dir().iterdir()) == []


def test_import_gguf_through_the_dialog(qtbot, dialog, tmp_path):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    dialog.start_import(str(gguf), "imported-tiny")
    qtbot.waitUntil(lambda: dialog.message.text() == "Added imported-tiny", timeout=60_000)
    assert names() == ["imported-tiny"]
    row = dialog.table.topLevelItem(0)
    assert row.text(3) == "Imported GGUF" and row.text(1).endswith(" MB")  # in words
    # Room for the focus ring round the text (it cut the letters' tops off: a walk).
    height = dialog.table.visualItemRect(row).height()
    assert height >= dialog.table.fontMetrics().height() + 4, height


def test_a_failed_import_says_why_in_the_dialog(qtbot, dialog, tmp_path):
    """Found on a new-user walk: the dialog said "Nothing was added" and the reason went
    to the window's status bar, behind the dialog."""
    damaged = tmp_path / "damaged.gguf"
    damaged.write_bytes(b"GGUF" + bytes(60))
    dialog.start_import(str(damaged), "damaged")
    qtbot.waitUntil(lambda: dialog.progress.isHidden(), timeout=60_000)
    said = dialog.message.text()
    assert said and said != "Importing damaged.gguf…" and "damaged.gguf" in said, said
    assert names() == []


@pytest.mark.parametrize(
    ("file", "offered"),
    [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),  # first start's name
        # Any other: the file's name, its quantization tag kept (two are two models).
        ("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3.1-8B-Instruct-Q4_K_M"),
    ],
)
def test_import_gguf_offers_the_name_first_start_gives(
    qtbot, dialog, monkeypatch, tmp_path, file, offered
):
    """Found on a new-user walk: the dialog offered "…Instruct.Q4_1" for the starter
    file, which first start imports as "…Instruct"; and its box showed about 20
    characters of it. The file dialog is the desktop's: it answers here as a user would."""
    from PySide6.QtWidgets import QFileDialog, QInputDialog

    chosen = tmp_path / file
    chosen.write_bytes(b"GGUF" + bytes(28))
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a: (str(chosen), ""))
    asked = []

    def read_and_cancel(box):
        line = box.findChild(QLineEdit)
        whole = line.width() > line.fontMetrics().horizontalAdvance(offered)
        asked.append((box.textValue(), whole))
        box.reject()

    when_a_box_opens(read_and_cancel, title="Import GGUF", kind=QInputDialog)
    dialog.choose_gguf()
    assert asked == [(offered, True)]  # offered, and shown whole
    assert dialog.progress.isHidden()  # cancelled: nothing imported


def test_a_file_that_is_no_gguf_is_refused_before_a_name_is_asked(
    qtbot, dialog, monkeypatch, tmp_path
):
    """New-user walk: notes.gguf (text) was given a name first, then refused."""
    from PySide6.QtWidgets import QFileDialog, QInputDialog

    notes = tmp_path / "notes.gguf"
    notes.write_text("shopping: milk, eggs")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a: (str(notes), ""))
    monkeypatch.setattr(QInputDialog, "exec", lambda box: pytest.fail("a name was asked for"))
    dialog.choose_gguf()
    assert dialog.message.text() == "notes.gguf is not a GGUF file: nothing was added."
    assert names() == []


def test_a_gguf_imported_before_is_not_imported_again_under_another_name(
    qtbot, tmp_path, monkeypatch
):
    """A new user's walk imported the starter again as "Smol copy": a second copy of the
    same weights, with no word that it was one."""
    from PySide6.QtWidgets import QFileDialog, QInputDialog

    import tiny
    from app.engine.gguf_import import import_gguf

    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    import_gguf(gguf, paths.models_dir(), "tiny")
    engine = WorkerThread()
    dialog = ModelsDialog(engine.worker)
    qtbot.addWidget(dialog)
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a: (str(gguf), ""))
    monkeypatch.setattr(QInputDialog, "exec", lambda box: pytest.fail("a name was asked for"))
    dialog.choose_gguf()
    assert dialog.message.text() == (
        "tiny.gguf is in the library already, as tiny: nothing was added."
    )
    assert names() == ["tiny"]
    engine.shutdown()


def test_the_model_in_use_is_marked_and_not_deleted(qtbot, tiny_model_dir, monkeypatch):
    """Deleting the loaded model would leave the window 'Ready' with nothing to run."""
    from PySide6.QtWidgets import QMessageBox

    shutil.copytree(tiny_model_dir, paths.models_dir() / "tiny")
    engine = WorkerThread()
    dialog = ModelsDialog(engine.worker, in_use="tiny")
    qtbot.addWidget(dialog)
    asked = []
    monkeypatch.setattr(QMessageBox, "question", lambda *a: asked.append(a))
    dialog.delete_selected()  # nothing chosen: it says what to do (it did nothing)
    assert dialog.message.text() == "Choose a model in the list above, then Delete."
    item = dialog.table.topLevelItem(0)
    assert item.text(0) == "tiny (in use)"
    dialog.table.setCurrentItem(item)
    dialog.delete_selected()
    assert "tiny" in names() and asked == []
    # The only model: there is no other to choose in the toolbar (a new user's walk).
    assert dialog.message.text() == (
        "tiny is the model in use: add another and load it from the toolbar first."
    )
    engine.shutdown()


class Asks(QObject):
    """Requests to the worker, queued onto its thread as the window's are."""

    load = Signal(str)
    send = Signal(int, str)
    save = Signal(object)


def test_found_models_are_imported_or_used_in_place_then_chatted_with(
    qtbot, app_dirs, tiny_model_dir, monkeypatch
):
    from PySide6.QtWidgets import QMessageBox

    hub = hf_tree(app_dirs["hf-hub"], tiny_model_dir)
    ollama_tree(app_dirs["ollama"])
    engine = WorkerThread()
    dialog = ModelsDialog(engine.worker)
    qtbot.addWidget(dialog)
    found = dialog.found.table
    qtbot.waitUntil(lambda: found.topLevelItemCount() == 2, timeout=30_000)
    rows = {found.topLevelItem(i).text(0): i for i in range(2)}
    assert sorted(rows) == ["mlx-community/tiny-4bit", "tiny:latest"]
    assert found.topLevelItem(rows["tiny:latest"]).text(1) == "Ollama"
    assert "skipped" in dialog.found.status.text()  # the broken entries, with reasons

    dialog.found.button(rows["mlx-community/tiny-4bit"]).click()
    qtbot.waitUntil(lambda: dialog.message.text() == "Added tiny-4bit", timeout=30_000)
    dialog.found.button(rows["tiny:latest"]).click()
    qtbot.waitUntil(lambda: dialog.message.text() == "Added tiny:latest", timeout=60_000)
    installed = {dialog.table.topLevelItem(i).text(0): i for i in range(2)}
    assert sorted(installed) == ["tiny-4bit", "tiny:latest"]
    linked = dialog.table.topLevelItem(installed["tiny-4bit"])
    header = [dialog.table.headerItem().text(c) for c in range(dialog.table.columnCount())]
    assert header == ["Name", "Size", "Context", "Source", "Architecture"]
    assert linked.text(3) == "Used in place" and linked.text(2).endswith(" tokens")
    assert linked.text(1).endswith(" MB") and linked.toolTip(1).startswith("Weights: ")
    qtbot.waitUntil(lambda: not dialog.found.button(0).isEnabled(), timeout=30_000)
    assert dialog.found.button(0).text() == "Installed"

    asks = Asks()
    asks.load.connect(engine.worker.load_model)
    asks.send.connect(engine.worker.send)
    asks.save.connect(engine.worker.save_preferences)
    asks.save.emit(Preferences(max_tokens=4, temperature=0.0))
    with qtbot.waitSignal(engine.worker.model_loaded, timeout=60_000) as loaded:
        asks.load.emit("tiny-4bit")
    assert loaded.args[0] == "tiny-4bit"
    with qtbot.waitSignal(engine.worker.finished, timeout=60_000) as replied:
        asks.send.emit(0, "hello there")
    assert replied.args[0].stats.generated_tokens > 0

    dialog.table.setCurrentItem(dialog.table.topLevelItem(installed["tiny-4bit"]))
    monkeypatch.setattr(QMessageBox, "question", lambda *a: QMessageBox.StandardButton.Yes)
    dialog.delete_selected()
    assert names() == ["tiny:latest"]
    assert (hub / "models--mlx-community--tiny-4bit" / "blobs").is_dir()
    assert all(p.is_file() for p in (hub / "models--mlx-community--tiny-4bit").rglob("*.json"))
    engine.shutdown()


def test_enter_on_a_found_row_imports_it_and_keeps_the_dialog_open(qtbot, tmp_path):
    """Tab reaches the list, not the buttons inside it: Enter (or Space) on a row presses
    its button; an installed one does nothing; the dialog's Close does not take Enter."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QDialog, QDialogButtonBox, QVBoxLayout

    from app.engine.found import GGUF, LMSTUDIO, Discovery, FoundModel
    from app.ui.found_list import FoundList

    dialog = QDialog()
    qtbot.addWidget(dialog)
    found_list = FoundList()
    close = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
    close.rejected.connect(dialog.reject)
    layout = QVBoxLayout(dialog)
    layout.addWidget(found_list)
    layout.addWidget(close)
    gguf = tmp_path / "a.gguf"
    rows = [
        FoundModel("a", "pub/a/a.gguf", LMSTUDIO, GGUF, gguf, 10),
        FoundModel("b", "pub/b/b.gguf", LMSTUDIO, GGUF, tmp_path / "b.gguf", 10, "b"),
    ]
    found_list.show_found(Discovery(rows))
    dialog.show()
    asked = []
    found_list.import_requested.connect(lambda path, name: asked.append((path, name)))
    found_list.table.setFocus()
    found_list.table.setCurrentItem(found_list.table.topLevelItem(0))
    qtbot.keyClick(found_list.table, Qt.Key.Key_Return)
    assert asked == [(str(gguf), "a")] and dialog.isVisible()
    found_list.table.setCurrentItem(found_list.table.topLevelItem(1))  # installed already
    qtbot.keyClick(found_list.table, Qt.Key.Key_Space)
    assert len(asked) == 1 and dialog.isVisible()


def test_a_pipe_named_gguf_is_refused_without_waiting(qtbot, dialog, monkeypatch, tmp_path):
    """Review: opening a FIFO to read its first bytes waited for a writer forever, on the
    window's thread."""
    import os

    from PySide6.QtWidgets import QFileDialog

    pipe = tmp_path / "pipe.gguf"
    os.mkfifo(pipe)
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *a: (str(pipe), ""))
    dialog.choose_gguf()
    assert dialog.message.text() == "pipe.gguf is not a regular file: nothing was added."


def test_an_mlx_folder_is_added_in_place_and_a_wrong_one_says_why(
    qtbot, dialog, repo, tmp_path, monkeypatch
):
    """A walk: only the terminal's `reprise models use` took a folder of one's own."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QFileDialog, QPushButton

    wrong = tmp_path / "badmodel"
    wrong.mkdir()
    (wrong / "config.json").write_text('{"model_type": "nonsense"}')
    chosen = iter([str(wrong), str(repo)])
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *args: next(chosen))
    [button] = [b for b in dialog.findChildren(QPushButton) if b.text() == "Add MLX folder…"]
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "'nonsense'" in dialog.message.text(), timeout=30_000)
    assert names() == []
    qtbot.mouseClick(button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: dialog.message.text() == "Added repo", timeout=30_000)
    assert names() == ["repo"]
    row = dialog.table.topLevelItem(0)
    assert row.toolTip(3) == f"Used in place from {repo}; Delete removes only the link"
