"""Imports run in a real child process: progress reaches the caller, a refusal keeps its
message, and a child killed by SIGSEGV (as a native loader crashing would) becomes a clear
error in the CLI and in the window, with nothing left in the models folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from app.engine.gguf_child import CRASH_AT_STAGE, import_in_child
from app.engine.gguf_import import GGUFImportError
from app.engine.loading import load
from app.engine.models import list_models
from app.ui.models_dialog import ModelsDialog
from app.worker import WorkerThread
from sessions import paths

REPRISE = str(Path(sys.executable).with_name("reprise"))


def nothing_in(models_dir: Path) -> bool:
    return not models_dir.exists() or list(models_dir.iterdir()) == []


def test_an_import_in_the_child_reports_progress_and_makes_a_loadable_model(tmp_path):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    stages: list[tuple[str, int, int]] = []
    imported = import_in_child(gguf, tmp_path / "models", "tiny", lambda *s: stages.append(s))
    assert imported.name == "tiny" and imported.architecture == "llama"
    assert stages[0][0] == "Reading the file" and stages[-1] == ("Done", 4, 4)
    assert load(imported.path).tokenizer.decode([5]) != ""


def test_a_refusal_in_the_child_keeps_its_message(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") * 2)
    with pytest.raises(GGUFImportError, match=r"tensor count \(1099511627776\)"):
        import_in_child(bad, tmp_path / "models", "bad")
    assert nothing_in(tmp_path / "models")


def test_a_crashed_child_is_a_clear_error_and_leaves_nothing(tmp_path, monkeypatch):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setenv(CRASH_AT_STAGE, "Saving the model")
    stages: list[str] = []
    with pytest.raises(GGUFImportError, match=r"crashed the importer \(SIGSEGV\)"):
        import_in_child(gguf, tmp_path / "models", "tiny", lambda s, d, t: stages.append(s))
    assert stages == ["Reading the file", "Building the tokenizer", "Converting the weights"]
    # It died inside its hidden staging folder, which it could not remove; the parent did.
    assert nothing_in(tmp_path / "models")


def test_the_cli_says_the_importer_crashed_without_a_traceback(tmp_path, app_dirs):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    env = {**os.environ, CRASH_AT_STAGE: "Converting the weights"}
    done = subprocess.run(
        [REPRISE, "models", "import-gguf", str(gguf), "--name", "tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert done.returncode == 1
    assert "[1/4] Building the tokenizer" in done.stderr  # progress still reached the terminal
    assert "reprise: Importing tiny.gguf crashed the importer (SIGSEGV)" in done.stderr
    assert "Traceback" not in done.stderr
    assert nothing_in(app_dirs["models"])


def test_the_window_shows_the_crash_as_a_message_and_lives_on(qtbot, tmp_path, monkeypatch):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    engine = WorkerThread()
    try:
        dialog = ModelsDialog(engine.worker)
        qtbot.addWidget(dialog)
        added: list[tuple[str, str]] = []
        engine.worker.model_added.connect(lambda *answer: added.append(answer))
        monkeypatch.setenv(CRASH_AT_STAGE, "Building the tokenizer")
        dialog.start_import(str(gguf), "tiny")
        qtbot.waitUntil(lambda: "crashed the importer" in dialog.message.text(), timeout=60_000)
        qtbot.waitUntil(lambda: bool(added))
        assert len(added) == 1 and "crashed the importer (SIGSEGV)" in added[0][1]
        assert dialog.message.text() == added[0][1]  # said in the dialog, where it was asked
        monkeypatch.delenv(CRASH_AT_STAGE)
        dialog.start_import(str(gguf), "tiny")  # the same window and worker go on
        qtbot.waitUntil(lambda: dialog.message.text() == "Added tiny", timeout=60_000)
        assert [m.name for m in list_models(paths.models_dir())] == ["tiny"]
    finally:
        engine.shutdown()
