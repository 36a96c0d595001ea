"""`reprise models ...`: the library, and the models other tools keep on this computer."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from app.commands.terminal_text import terminal_safe
from app.engine import found, models
from app.engine.errors import UserError
from sessions import paths


def run(args: argparse.Namespace) -> int:
    models_dir = paths.models_dir()
    command = args.models_command
    if command == "list":
        return _list(models_dir, args.json)
    if command == "found":
        return _found(models_dir, args.json)
    if command == "import-gguf":
        return _import(args, models_dir)
    if command == "use":
        return _use(args, models_dir)
    if command == "delete":
        models.delete(args.name, models_dir)
        print(f"Deleted {args.name}")
        return 0
    return 2


def _list(models_dir: Path, as_json: bool) -> int:
    installed = models.list_models(models_dir)
    if as_json:
        print(json.dumps([m.to_dict() for m in installed], indent=2))
        return 0
    if not installed:
        print(f"No models in {models_dir}")
    for m in installed:
        where = f"  (in place: {m.in_place})" if m.in_place else ""
        print(f"{m.name:40} {m.architecture:10} {m.weights}{where}")
    return 0


def _discover(models_dir: Path) -> found.Discovery:
    return found.discover(installed=models.list_models(models_dir))


def _found(models_dir: Path, as_json: bool) -> int:
    discovery = _discover(models_dir)
    if as_json:
        skipped = [{"path": str(s.path), "reason": s.reason} for s in discovery.skipped]
        found_ = [f.to_dict() for f in discovery.found]
        print(json.dumps({"found": found_, "skipped": skipped}, indent=2))
        return 0
    if not discovery.found:
        print("No LM Studio, Ollama or Hugging Face models found on this computer")
    for f in discovery.found:
        # Names come from other programs' folders: nothing in them reaches the terminal raw.
        how = f"installed as {f.installed_as}" if f.installed_as else _how(f)
        label = terminal_safe(f.label)
        print(f"{f.source:13} {label:48} {f.size_bytes / 1e9:6.2f} GB  {terminal_safe(how)}")
    for s in discovery.skipped:
        print(f"skipped {terminal_safe(str(s.path))}: {terminal_safe(s.reason)}", file=sys.stderr)
    return 0


def _how(item: found.FoundModel) -> str:
    if item.kind == found.GGUF:
        return f"reprise models import-gguf '{item.label}'"
    return f"reprise models use '{item.label}'"


def _import(args: argparse.Namespace, models_dir: Path) -> int:
    from app.engine.gguf_child import import_in_child

    path, name = Path(args.path).expanduser(), args.name
    if path.is_dir():
        raise UserError(
            f"{path} is a folder, not a GGUF file (a folder of an MLX model is added with "
            f"`reprise models use '{path}'`)"
        )
    if not path.is_file():  # not a file: the name of a GGUF another tool keeps?
        item = found.find(args.path, _discover(models_dir))
        if item is None or item.kind != found.GGUF:
            raise UserError(f"No such file, and no GGUF found by that name: {args.path}")
        path, name = item.path, name or item.name
    name = name or path.stem
    if args.if_missing and models.read_info(models_dir / name):
        print(f"{name} is already installed")
        return 0

    def progress(stage: str, done: int, total: int) -> None:
        print(f"[{done}/{total}] {stage}", file=sys.stderr)

    bits = None if args.bits == "file" else int(args.bits)
    imported = import_in_child(path, models_dir, name, progress, bits)
    print(f"Imported {imported.name} into {imported.path}; weights: {imported.weights}")
    return 0


def _use(args: argparse.Namespace, models_dir: Path) -> int:
    folder = Path(args.folder).expanduser()
    name = args.name
    if not folder.is_dir():  # not a folder: the name of an MLX model found elsewhere?
        item = found.find(args.folder, _discover(models_dir))
        if item is None or item.kind != found.MLX:
            raise UserError(f"No such folder, and no MLX model found by that name: {args.folder}")
        folder, name = item.path, name or item.name
    linked = models.link_folder(folder, models_dir, name or folder.name)
    print(f"Added {linked.name}, used in place from {folder} (nothing was copied)")
    return 0
