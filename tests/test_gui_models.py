"""The Models dialog: download from a (stand-in) hub with progress and cancel; GGUF import."""

from __future__ import annotations

import shutil

import pytest
from hub_server import FakeHub

import tiny
from app.engine.models import list_models
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


def test_cancel_stops_the_download_and_keeps_nothing(qtbot, dialog, repo, monkeypatch):
    with FakeHub({"mlx-community/tiny": repo}, seconds_per_block=0.05) as hub:
        monkeypatch.setenv("REPRISE_HF_ENDPOINT", hub.endpoint)
        dialog.start_download("mlx-community/tiny")
        qtbot.waitUntil(lambda: "MB" in dialog.message.text(), timeout=60_000)
        dialog.cancel_button.click()
        qtbot.waitUntil(lambda: dialog.message.text() == "Nothing was added", timeout=60_000)
    assert names() == []
    assert list(paths.models_dir().iterdir()) == []


def test_import_gguf_through_the_dialog(qtbot, dialog, tmp_path):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    dialog.start_import(str(gguf), "imported-tiny")
    qtbot.waitUntil(lambda: dialog.message.text() == "Added imported-tiny", timeout=60_000)
    assert names() == ["imported-tiny"]


def test_the_model_in_use_is_marked_and_not_deleted(qtbot, tiny_model_dir, monkeypatch):
    """Deleting the loaded model would leave the window 'Ready' with nothing to run."""
    from PySide6.QtWidgets import QMessageBox

    shutil.copytree(tiny_model_dir, paths.models_dir() / "tiny")
    engine = WorkerThread()
    dialog = ModelsDialog(engine.worker, in_use="tiny")
    qtbot.addWidget(dialog)
    asked = []
    monkeypatch.setattr(QMessageBox, "question", lambda *a: asked.append(a))
    item = dialog.table.topLevelItem(0)
    assert item.text(0) == "tiny (in use)"
    dialog.table.setCurrentItem(item)
    dialog.delete_selected()
    assert "tiny" in names() and asked == []
    assert dialog.message.text().startswith("tiny is the model in use")
    engine.shutdown()
