"""The local model library: one folder per model under the models dir.

An entry is a folder of its own (an import, a download) or a symbolic link to an
MLX model folder that another tool keeps (the Hugging Face cache, LM Studio): such
a model is used in place, without copying gigabytes, and deleting it removes only
the link. Loading, fingerprints and sizes all see through the link.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from app.engine.errors import UserError

STARTER_MODEL = "SmolLM2-135M-Instruct"


class ModelNotFound(UserError):
    pass


class NoModels(ModelNotFound):
    """The library is empty (the terminal and the window say what to do differently)."""


class NotAModel(UserError):
    """A folder offered to be used in place is not one mlx-lm can load."""


# config.json is a few kilobytes; a larger one is not a model's (and is not read whole).
_MAX_CONFIG_BYTES = 4 << 20


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    size_bytes: int
    architecture: str
    quantization: str
    source: str
    context_length: int | None = None
    in_place: Path | None = None  # the folder a linked model is used from
    gguf: tuple[str, int] | None = None  # the GGUF imported: its file's name and size

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        data["in_place"] = str(self.in_place) if self.in_place else None
        data["gguf"] = list(self.gguf) if self.gguf else None
        return data

    @property
    def weights(self) -> str:
        """One line: how the weights are stored, their size, the context length."""
        parts = [self.quantization, f"{self.size_bytes / 1e9:.2f} GB"]
        if self.context_length:
            parts.append(f"{self.context_length:,} tokens of context")
        return ", ".join(parts)


def _describe_quantization(config: dict) -> str:
    quant = config.get("quantization")
    if not quant:
        return "not quantized"
    if not isinstance(quant, dict):  # a folder another tool wrote: anything can be here
        return "unknown"
    return f"{quant.get('bits')}-bit, group {quant.get('group_size')}"


def _context_length(config: dict) -> int | None:
    inner = config.get("text_config")
    for place in (config, inner if isinstance(inner, dict) else {}):
        value = place.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def read_config(folder: Path) -> dict | None:
    """A model folder's config.json as a dict, or None (missing, too large, not JSON)."""
    try:
        path = folder / "config.json"
        if not path.is_file() or path.stat().st_size > _MAX_CONFIG_BYTES:
            return None
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def folder_size(folder: Path) -> int:
    """The bytes of the files in `folder` (through links: the cache's blobs)."""
    total = 0
    for f in folder.iterdir():
        try:
            total += f.stat().st_size if f.is_file() else 0
        except OSError:
            continue  # a link to nowhere, or a loop: not part of the model
    return total


def read_info(path: Path) -> ModelInfo | None:
    """Describe the model folder at `path`, or None if it is not one."""
    config = read_config(path)
    if config is None:
        return None
    linked = path.resolve() if path.is_symlink() else None
    reprise = config.get("reprise") if isinstance(config.get("reprise"), dict) else {}
    return ModelInfo(
        name=path.name,
        path=path,
        size_bytes=folder_size(path),
        architecture=str(config.get("model_type", "unknown")),
        quantization=str(reprise.get("weights") or _describe_quantization(config)),
        source="in place" if linked else str(reprise.get("source", "mlx")),
        context_length=_context_length(config),
        in_place=linked,
        gguf=_imported_from(reprise),
    )


def _imported_from(reprise: dict) -> tuple[str, int] | None:
    """The GGUF file an import was made from: its name and size in bytes. None for an
    import that did not keep its size (before 7 December 2026): two publishers' files
    often share a name (`model.gguf`), so a name alone says nothing."""
    name, size = reprise.get("gguf_file"), reprise.get("gguf_bytes")
    if not isinstance(name, str) or not name:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        return None
    return name, size


def list_models(models_dir: Path) -> list[ModelInfo]:
    """Every usable model folder, by name; hidden folders (imports in progress) are skipped."""
    if not models_dir.is_dir():
        return []
    found = (
        read_info(p)
        for p in sorted(models_dir.iterdir())
        if p.is_dir() and not p.name.startswith(".")
    )
    return [info for info in found if info is not None]


def resolve(name_or_path: str | None, models_dir: Path) -> Path:
    """Find a model by name in the library, or by folder path; None means the default."""
    if name_or_path is None:
        models = list_models(models_dir)
        if not models:
            raise NoModels(
                f"No models in {models_dir}. Import one with "
                "`reprise models import-gguf FILE`, or run `make run` for the starter model."
            )
        names = [m.name for m in models]
        return models_dir / (STARTER_MODEL if STARTER_MODEL in names else names[0])
    candidate = models_dir / name_or_path
    if "/" not in name_or_path and read_info(candidate):
        return candidate
    path = Path(name_or_path).expanduser()
    if read_info(path):
        return path
    known = ", ".join(m.name for m in list_models(models_dir)) or "none"
    raise ModelNotFound(f"No model {name_or_path!r} (installed: {known})")


@contextmanager
def staged_folder(models_dir: Path, name: str, kind: str) -> Iterator[Path]:
    """A hidden folder to build model `name` in, renamed into place only if the block
    completes; on any failure (or Cancel) it is removed and nothing is left behind.
    Hidden folders are skipped by `list_models`."""
    models_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{kind}-{name}-", dir=models_dir))
    try:
        yield staging
        _into_place(staging, models_dir / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _into_place(staging: Path, target: Path) -> None:
    """A review: a dangling link by the model's name (a model used in place whose folder
    went) let a whole download through, then failed its rename as "a bug"."""
    if target.is_symlink() or target.exists():
        raise UserError(f"A model named {target.name!r} already exists in {target.parent}")
    try:
        staging.rename(target)
    except OSError as exc:
        raise UserError(
            f"Could not put the model in place as {target}: {exc.strerror or exc}"
        ) from exc


def file_sha256(path: Path) -> str:
    """The SHA-256 of a (model) file, read a MiB at a time."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_name(name: str) -> None:
    """A library name is one visible folder name."""
    if not name or name.startswith(".") or "/" in name or "\\" in name or name in {"..", "."}:
        raise UserError(
            f"{name!r} is not a usable model name: a model's name is one folder's, "
            "without / or \\, and not starting with a dot"
        )


def mlx_folder_problem(folder: Path) -> str | None:
    """Why mlx-lm could not load the model folder `folder`, or None if it looks loadable:
    its config names a model type mlx-lm has, and its weights and tokenizer are there
    (a download cut short leaves links to blobs that never arrived)."""
    config = read_config(folder)
    if config is None:
        return "no readable config.json"
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not _mlx_lm_runs(model_type):
        return f"model type {model_type!r} is not one mlx-lm runs"
    try:
        weights = list(folder.glob("*.safetensors"))
        if not weights:
            return "no .safetensors weights"
        if not all(f.is_file() for f in weights):
            return "some weight files are missing (an unfinished download?)"
        if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            return "no tokenizer files"
    except OSError as exc:
        return f"could not be read ({exc.strerror or exc})"
    return None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def _mlx_lm_runs(model_type: str) -> bool:
    """Whether mlx-lm has a model class for `model_type` (its own renames included)."""
    from mlx_lm.utils import MODEL_REMAPPING

    module = MODEL_REMAPPING.get(model_type, model_type)
    if not module.isidentifier():
        return False
    return importlib.util.find_spec(f"mlx_lm.models.{module}") is not None


def link_folder(folder: Path, models_dir: Path, name: str) -> Path:
    """Add the MLX model folder `folder` to the library as `name`, used in place."""
    check_name(name)
    folder = Path(folder).expanduser()
    problem = mlx_folder_problem(folder) if folder.is_dir() else "not a folder"
    if problem:
        raise NotAModel(f"{folder} cannot be used as a model: {problem}")
    models_dir.mkdir(parents=True, exist_ok=True)
    target = models_dir / name
    if target.is_symlink() and not target.exists():
        target.unlink()  # a link left to a folder since removed: the name is free
    if target.exists():
        raise UserError(f"A model named {name!r} already exists in {models_dir}")
    os.symlink(folder.resolve(), target, target_is_directory=True)
    return target


def delete(name: str, models_dir: Path) -> None:
    """Remove a model; one used in place loses only its link, never the folder."""
    path = models_dir / name
    if "/" in name or name.startswith("."):
        raise ModelNotFound(f"No model {name!r} in {models_dir}")
    if path.is_symlink():
        path.unlink()
        return
    if read_info(path) is None:
        raise ModelNotFound(f"No model {name!r} in {models_dir}")
    shutil.rmtree(path)
