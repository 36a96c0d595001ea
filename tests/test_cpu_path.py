"""The engine arranges a fast BLAS for mlx on Linux by itself, and says what it chose."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
SHOW = "import app.engine.blas as b; print(b.CHOICE.name); print(b.CHOICE.note)"


def choice(code: str = SHOW, **env_extra: str) -> list[str]:
    env = {**os.environ, **env_extra}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, check=True
    )
    return done.stdout.splitlines()


linux_only = pytest.mark.skipif(
    platform.system() != "Linux", reason="OpenBLAS preload is Linux-only"
)


@linux_only
def test_openblas_is_preloaded_and_serves_mlx_matmuls():
    # `make` installs Debian's libopenblas0; mlx's cblas_sgemm must then resolve to it.
    code = SHOW + (
        "\nimport mlx.core as mx\nmx.eval(mx.ones((64, 64)) @ mx.ones((64, 64)))"
        "\nprint([l.split()[-1] for l in open('/proc/self/maps') if 'openblas' in l][:1])"
    )
    name, note, maps = choice(code=code)
    assert name == "openblas", note
    assert "libopenblas" in maps


@linux_only
def test_openblas_can_be_turned_off():
    name, note = choice(REPRISE_OPENBLAS="off")
    assert name == "reference" and "REPRISE_OPENBLAS=off" in note


@linux_only
def test_a_late_preload_says_so():
    name, note = choice(code="import mlx.core\n" + SHOW)
    assert name == "reference" and "imported before" in note


@linux_only
def test_this_test_process_runs_on_openblas_too():
    # Guards the import order in conftest: the starter-model tests would crawl otherwise.
    from app.engine import blas

    assert blas.CHOICE.name == "openblas", blas.CHOICE.note
