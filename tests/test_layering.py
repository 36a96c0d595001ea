"""Dependencies point one way: ui -> worker -> engine -> sessions (DESIGN.md §1)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def imported_modules(folder: Path) -> dict[str, set[str]]:
    found = {}
    for path in folder.rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path}: {name}"
        for path, names in imported_modules(ROOT / folder).items()
        for name in names
        if name.split(".")[0] in forbidden
    ]


@pytest.mark.parametrize("folder", ["app/engine", "sessions"])
def test_engine_and_sessions_do_not_import_qt(folder):
    assert offenders(folder, ("PySide6", "shiboken6")) == []


def test_sessions_do_not_import_model_code():
    assert offenders("sessions", ("mlx", "mlx_lm", "app")) == []


def test_the_gui_does_not_import_mlx():
    assert offenders("app/ui", ("mlx", "mlx_lm")) == []


def test_engine_and_sessions_import_without_qt_at_run_time():
    code = (
        "import sys, app.engine.chat, app.engine.gguf_import, sessions.paths;"
        "print(any(m.startswith('PySide6') for m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr
