"""The wheel as a user installs it: built from the project, installed into a fresh
virtual environment (not editable, run outside the checkout), then `reprise
--version`, a one-turn chat, and a short `reprise bench cpu`, which reads the
texts in `resources/`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Built from a copy of the tracked files, so the checkout is left untouched."""
    source = tmp_path_factory.mktemp("source")
    files = run("git", "ls-files", "--cached", "--others", "--exclude-standard", cwd=ROOT)
    for name in files.stdout.splitlines():
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("dist")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "--no-build-isolation",
        source,
        "-w",
        out,
    )
    return next(out.glob("reprise_chat-*.whl"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh venv with the wheel; its dependencies are this environment's, reached
    through a .pth line (a path line adds no editable finder: `app` comes from the
    wheel alone)."""
    env = tmp_path_factory.mktemp("venv")
    venv.create(env, with_pip=False)
    site = next((env / "lib").glob("python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        env / "bin" / "python",
        "install",
        "-q",
        "--no-deps",
        "--no-index",
        wheel,
    )
    return env / "bin"


def test_the_wheel_carries_the_resources(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "reprise_resources/kv-bench.json" in names
    assert "reprise_resources/text/ordinary-english.txt" in names
    assert {"app/service/chat.py", "app/ui/main_window.py", "sessions/db.py"} <= set(names)


def test_the_installed_app_runs_outside_the_checkout(installed, tiny_model_dir, tmp_path):
    env = {
        **os.environ,
        **{
            f"REPRISE_{d.upper()}_DIR": str(tmp_path / d)
            for d in ("data", "cache", "models", "log")
        },
    }
    where = run(
        installed / "python", "-c", "import app; print(app.__file__)", cwd=tmp_path, env=env
    )
    assert not where.stdout.startswith(str(ROOT)), where.stdout  # the wheel's, not ours
    reprise = installed / "reprise"
    assert run(reprise, "--version", cwd=tmp_path, env=env).stdout.startswith("reprise ")
    chat = run(
        reprise,
        "chat",
        "--model",
        tiny_model_dir,
        "--temp",
        "0",
        "--max-tokens",
        "4",
        "--json",
        "hello",
        cwd=tmp_path,
        env=env,
    )
    assert json.loads(chat.stdout)["generated_tokens"] == 4
    bench = run(
        reprise,
        "bench",
        "cpu",
        "--model",
        tiny_model_dir,
        "--prompt-tokens",
        "64",
        "--json",
        cwd=tmp_path,
        env=env,
    )
    assert json.loads(bench.stdout)["engine"]["prompt_tokens"] > 0
