"""Dependencies point one way (docs/architecture.md): the import-linter contracts
in pyproject.toml, checked by `lint-imports` over every module, indirect imports
included; and, at run time, the engine and storage load without Qt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

# One test writes a probe module into the checkout, which a test beside it could pick up.
pytestmark = pytest.mark.alone

ROOT = Path(__file__).parents[1]
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def test_the_import_contracts_are_kept():
    done = subprocess.run(
        [LINT_IMPORTS, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


def test_a_broken_contract_is_reported(tmp_path):
    """The check can fail: storage importing the engine breaks two contracts."""
    bad = ROOT / "sessions" / "_layering_probe.py"
    bad.write_text("import app.engine.chat  # noqa: F401\n")
    try:
        done = subprocess.run(
            [LINT_IMPORTS, "--no-cache"], capture_output=True, text=True, cwd=ROOT, timeout=120
        )
    finally:
        bad.unlink()
    assert done.returncode != 0
    assert "sessions._layering_probe -> app.engine.chat" in done.stdout


def test_engine_and_sessions_import_without_qt_at_run_time():
    code = (
        "import sys, app.service.chat, app.engine.gguf_import, sessions.paths;"
        "print(any(m.startswith('PySide6') for m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr
