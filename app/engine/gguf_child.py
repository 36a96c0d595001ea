"""A GGUF import run in a child process, so a crash in a native loader is an error, not the end.

`gguf_check` refuses every bad file we know how to describe, but the import still
hands the file to mlx's C++ reader and to `tokenizers`; should either crash (a
segfault, an abort), only the child dies, and the caller gets a `GGUFImportError`
saying so. Nothing is left behind: the folder is only renamed into place when the
child completes, and a crashed child's hidden staging folder is removed here.

The child speaks JSON lines on a pipe of its own (its stdout, moved away from fd 1
so that a native library printing cannot garble it): `{"progress": [stage, done,
total]}` any number of times, then one of `{"imported": ...}`, `{"refused":
message}` (a user error) or `{"bug": traceback}`.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from app.engine.gguf_import import GGUFImportError, ImportedModel, Progress
from sessions import paths

log = logging.getLogger(__name__)

# For tests: the child kills itself with SIGSEGV when it reports this stage, as a
# native loader crashing there would.
CRASH_AT_STAGE = "REPRISE_TEST_IMPORT_CRASH_AT"


def import_in_child(
    gguf_path: Path,
    models_dir: Path,
    name: str | None = None,
    progress: Progress | None = None,
    bits: int | None = None,
) -> ImportedModel:
    """`gguf_import.import_gguf` in a child process; progress arrives here as it happens."""
    report = progress or (lambda stage, done, total: None)
    request = {"gguf": str(gguf_path), "models": str(models_dir), "name": name, "bits": bits}
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen(
            child_command(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env=env,
            text=True,
        )
        child.stdin.write(json.dumps(request))
        child.stdin.close()
        outcome = _read_messages(child.stdout, report)
        code = child.wait()
        errors.seek(0)
        child_stderr = errors.read().decode("utf-8", "replace")[-4000:]
    if "imported" in outcome:
        found = outcome["imported"]
        return ImportedModel(
            found["name"], Path(found["path"]), found["architecture"], found.get("weights", "")
        )
    if "refused" in outcome:
        raise GGUFImportError(outcome["refused"])
    _remove_staging(models_dir, name or Path(gguf_path).stem)
    if "bug" in outcome:
        log.error("the GGUF import failed:\n%s", outcome["bug"])
        raise GGUFImportError(
            f"Importing {Path(gguf_path).name} failed because of a bug; "
            f"the log has the details: {paths.log_file()}"
        )
    log.error("the GGUF import process ended with %s:\n%s", code, child_stderr)
    raise GGUFImportError(
        f"Importing {Path(gguf_path).name} crashed the importer ({_describe(code)}); "
        "the file is probably damaged in a way our checks do not catch. Nothing was added."
    )


def _read_messages(lines, report: Progress) -> dict:
    outcome: dict = {}
    for line in lines:
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            continue  # not ours
        if isinstance(message, dict) and "progress" in message:
            report(*message["progress"])
        elif isinstance(message, dict):
            outcome = message
    return outcome


def _describe(code: int) -> str:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


def _remove_staging(models_dir: Path, name: str) -> None:
    """A crashed child cannot clean up its hidden staging folder (models.staged_folder)."""
    for leftover in Path(models_dir).glob(f".import-{glob.escape(name)}-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def run_child() -> int:
    """The child's side: read the request on stdin, import, report on stdout."""
    import faulthandler
    import traceback

    # Our messages go to the original stdout; anything else printed to fd 1 goes to stderr.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    faulthandler.enable()

    import app.engine  # noqa: F401  (OpenBLAS before mlx)
    from app.engine.gguf_import import import_gguf
    from sessions.errors import UserError

    request = json.loads(sys.stdin.read())
    crash_at = os.environ.get(CRASH_AT_STAGE)

    def send(message: dict) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    def progress(stage: str, done: int, total: int) -> None:
        if stage == crash_at:
            os.kill(os.getpid(), signal.SIGSEGV)
        send({"progress": [stage, done, total]})

    try:
        imported = import_gguf(
            Path(request["gguf"]),
            Path(request["models"]),
            request["name"],
            progress,
            request.get("bits"),
        )
    except UserError as exc:
        send({"refused": str(exc)})
    except OSError as exc:  # a full disk, a folder that cannot be written
        send({"refused": f"The model could not be written: {exc.strerror or exc}"})
    except Exception:
        send({"bug": traceback.format_exc()})
    else:
        found = {"name": imported.name, "path": str(imported.path)}
        send(
            {
                "imported": found
                | {"architecture": imported.architecture, "weights": imported.weights}
            }
        )
    return 0


# A frozen app (PyInstaller) has no `python -m`: its executable is the app, whose entry
# point (packaging/reprise_entry.py) runs the child when given this one argument.
FROZEN_CHILD_FLAG = "--gguf-import-child"


def child_command() -> list[str]:
    """How to start the import child: the interpreter with this module, or the frozen app."""
    if getattr(sys, "frozen", False):
        return [sys.executable, FROZEN_CHILD_FLAG]
    return [sys.executable, "-m", "app.engine.gguf_child"]


if __name__ == "__main__":
    sys.exit(run_child())
