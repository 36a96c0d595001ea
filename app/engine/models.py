"""The local model library: one folder per model under the models dir."""

from __future__ import annotations

import json
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


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: Path
    size_bytes: int
    architecture: str
    quantization: str
    source: str

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        return data


def _describe_quantization(config: dict) -> str:
    quant = config.get("quantization")
    if not quant:
        return "none"
    return f"{quant.get('bits')}-bit, group {quant.get('group_size')}"


def read_info(path: Path) -> ModelInfo | None:
    """Describe the model folder at `path`, or None if it is not one."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return ModelInfo(
        name=path.name,
        path=path,
        size_bytes=size,
        architecture=config.get("model_type", "unknown"),
        quantization=_describe_quantization(config),
        source=config.get("reprise", {}).get("source", "mlx"),
    )


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
        staging.rename(models_dir / name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def delete(name: str, models_dir: Path) -> None:
    path = models_dir / name
    if "/" in name or name.startswith(".") or read_info(path) is None:
        raise ModelNotFound(f"No model {name!r} in {models_dir}")
    shutil.rmtree(path)
