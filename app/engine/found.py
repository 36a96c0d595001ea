"""Models already on this computer: LM Studio's, Ollama's, the Hugging Face cache's, and
GGUF files in the Downloads folder.

GGUF files (LM Studio's, Ollama's blobs) can be imported through the GGUF import;
MLX folders (a Hugging Face cache snapshot, an MLX model in LM Studio's folder)
can be used in place (`models.link_folder`). Each tool's folder is found the way
the tool itself finds it, environment variables first.

Everything read there is untrusted (DESIGN §12): another program wrote it, and a
user may have anything in these folders. A manifest that is not JSON, a digest that
is not a digest, a blob that is missing or not GGUF, a link to nowhere or to itself:
each becomes a `Skipped` with its reason. No folder is walked twice (a link back up
the tree ends there), the walk goes only as deep as each layout needs, and it stops
after a number of entries and seconds, saying so.
"""

from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from app.engine.models import ModelInfo, folder_size, mlx_folder_problem, read_config
from sessions import paths

LMSTUDIO, OLLAMA, HUGGING_FACE, DOWNLOADS = "LM Studio", "Ollama", "Hugging Face", "Downloads"
GGUF, MLX = "gguf", "mlx"

_GGUF_MAGIC = b"GGUF"
_OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_LIBRARY = ("registry.ollama.ai", "library")
_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_REVISION = re.compile(r"[0-9a-f]{40}")
_SPLIT_PART = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_MAX_MANIFEST_BYTES = 1 << 20
_MAX_SMALL_FILE = 64 << 10  # a settings file or a pointer


@dataclass(frozen=True)
class FoundModel:
    name: str  # the library name it gets by default (Ollama: model:tag)
    label: str  # what the tool calls it: "publisher/repo/file.gguf", "llama3.2:3b", "org/name"
    source: str  # LMSTUDIO, OLLAMA or HUGGING_FACE
    kind: str  # GGUF (import it) or MLX (use it in place)
    path: Path  # the GGUF file, or the MLX folder
    size_bytes: int
    installed_as: str = ""  # the library model made from it, if there is one

    def to_dict(self) -> dict:
        data = asdict(self)
        data["path"] = str(self.path)
        data["installed_as"] = self.installed_as or None
        return data


@dataclass(frozen=True)
class Skipped:
    path: Path
    reason: str


@dataclass
class Discovery:
    found: list[FoundModel] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


@dataclass(frozen=True)
class Locations:
    """Where each tool keeps its models; a folder that does not exist is simply empty."""

    lmstudio: tuple[Path, ...]
    ollama: Path
    huggingface: Path
    downloads: tuple[Path, ...] = ()  # GGUF files a browser saved (the top level only)

    @classmethod
    def from_environment(
        cls, env: Mapping[str, str] | None = None, home: Path | None = None
    ) -> Locations:
        env = os.environ if env is None else env
        if home is None or env.get("REPRISE_DOWNLOADS_DIR"):
            downloads = paths.downloads_dir(env)
        else:  # a home given (tests): its Downloads
            downloads = home / "Downloads"
        home = Path.home() if home is None else home
        if env.get("REPRISE_LMSTUDIO_MODELS"):
            lmstudio: tuple[Path, ...] = (Path(env["REPRISE_LMSTUDIO_MODELS"]).expanduser(),)
        else:
            lmstudio = _lmstudio_folders(home)
        ollama = Path(env.get("OLLAMA_MODELS") or home / ".ollama/models").expanduser()
        if env.get("HF_HUB_CACHE"):
            hub = Path(env["HF_HUB_CACHE"])
        elif env.get("HF_HOME"):
            hub = Path(env["HF_HOME"]) / "hub"
        else:
            hub = home / ".cache/huggingface/hub"
        return cls(lmstudio, ollama, hub.expanduser(), (downloads,))


def _lmstudio_folders(home: Path) -> tuple[Path, ...]:
    """LM Studio's home may be moved (`~/.lmstudio-home-pointer` names it) and its models
    folder too (`downloadsFolder` in its settings); the older app used ~/.cache/lm-studio."""
    homes = [home / ".lmstudio"]
    pointed = _small_text(home / ".lmstudio-home-pointer")
    if pointed:
        homes.insert(0, Path(pointed.strip()).expanduser())
    folders = []
    for base in homes:
        try:
            settings = json.loads(_small_text(base / "settings.json") or "null")
        except ValueError:
            settings = None
        chosen = settings.get("downloadsFolder") if isinstance(settings, dict) else None
        if isinstance(chosen, str) and chosen:
            folders.append(Path(chosen).expanduser())
        folders.append(base / "models")
    folders.append(home / ".cache/lm-studio/models")
    return tuple(dict.fromkeys(folders))  # in order, once each


def _small_text(path: Path) -> str | None:
    try:
        if path.is_file() and path.stat().st_size <= _MAX_SMALL_FILE:
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    return None


class _Budget:
    """Stops a walk of a huge (or slow, networked) folder: so many entries, so many seconds.
    It also remembers the folders walked, so a link back up the tree is not walked again."""

    def __init__(self, seconds: float, entries: int) -> None:
        self.deadline = time.monotonic() + seconds
        self.entries = entries
        self.spent = False
        self.walked: set[tuple[int, int]] = set()

    def first_visit(self, folder: Path) -> bool:
        identity = folder.stat()
        key = (identity.st_dev, identity.st_ino)
        if key in self.walked:
            return False
        self.walked.add(key)
        return True

    def take(self) -> bool:
        self.entries -= 1
        if self.entries < 0 or time.monotonic() > self.deadline:
            self.spent = True
        return not self.spent


def discover(
    locations: Locations | None = None,
    installed: Iterable[ModelInfo] = (),
    seconds: float = 10.0,
    max_entries: int = 50_000,
) -> Discovery:
    """Every model found in the tools' folders, and every entry skipped, with why."""
    locations = locations or Locations.from_environment()
    result = Discovery()
    budget = _Budget(seconds, max_entries)
    walks = [(folder, _lmstudio) for folder in locations.lmstudio]
    walks += [(locations.ollama, _ollama), (locations.huggingface, _huggingface)]
    walks += [(folder, _downloads) for folder in locations.downloads]
    for root, walk in walks:
        if not _is_folder(root):
            continue
        try:
            for item in walk(root, budget):
                (result.found if isinstance(item, FoundModel) else result.skipped).append(item)
        except OSError as exc:
            result.skipped.append(Skipped(root, f"could not be read ({exc.strerror or exc})"))
        if budget.spent:
            result.skipped.append(
                Skipped(root, f"stopped looking after {max_entries} entries or {seconds:.0f} s")
            )
            break
    result.found = _mark_installed(result.found, list(installed))
    return result


def _is_folder(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:
        return False


Item = FoundModel | Skipped


def _entries(folder: Path, budget: _Budget) -> Iterator[os.DirEntry]:
    """A folder's entries, sorted, within the budget."""
    with os.scandir(folder) as listing:
        entries = sorted(listing, key=lambda e: e.name)
    for entry in entries:
        if not budget.take():
            return
        yield entry


def _lmstudio(root: Path, budget: _Budget, depth: int = 0) -> Iterator[Item]:
    """publisher/repo/file.gguf, or publisher/repo/ holding an MLX model (LM Studio on a Mac)."""
    if read_config(root) is not None and depth > 0:
        yield _mlx_item(root, "/".join(root.parts[-depth:]), root.name, LMSTUDIO)
        return
    if not budget.first_visit(root):
        return  # a link to a folder already walked (a loop, or the same folder twice)
    for entry in _entries(root, budget):
        path = Path(entry.path)
        try:
            # Links to folders are followed (people link a repo in); `first_visit` ends loops.
            is_folder = entry.is_dir()
        except OSError as exc:  # a link to itself, say
            yield Skipped(path, f"could not be read ({exc.strerror or exc})")
            continue
        if is_folder and not entry.name.startswith(".") and depth < 3:
            try:
                yield from _lmstudio(path, budget, depth + 1)
            except OSError as exc:
                yield Skipped(path, f"could not be read ({exc.strerror or exc})")
        elif entry.name.lower().endswith(".gguf"):
            label = "/".join((*path.parts[-depth - 1 : -1], entry.name)) if depth else entry.name
            yield _gguf_file(path, label, LMSTUDIO)


def _downloads(root: Path, budget: _Budget) -> Iterator[Item]:
    """The GGUF files at the top of the Downloads folder (where first start looks for the
    starter model: a new-user walk found it there and not in this list)."""
    with os.scandir(root) as listing:  # the budget is for GGUF files, not the rest
        names = sorted(
            entry.name
            for entry in listing
            if entry.name.lower().endswith(".gguf") and not entry.name.startswith(".")
        )
    for name in names:
        if not budget.take():
            return
        yield _gguf_file(root / name, name, DOWNLOADS)


def _gguf_file(path: Path, label: str, source: str) -> Item:
    """A GGUF file another tool or a browser left, unless it is no model of its own."""
    if not _is_text(str(path)):
        return Skipped(path, "its name is not valid text, so it cannot be imported by name")
    if path.name.lower().startswith("mmproj"):
        return Skipped(path, "a vision projector, not a language model")
    part = _SPLIT_PART.search(path.name)
    if part:
        return Skipped(path, f"part {int(part[1])} of {int(part[2])} of a split GGUF (unsupported)")
    return _gguf_item(path, label, path.name[: -len(".gguf")], source)


def _gguf_item(path: Path, label: str, name: str, source: str) -> Item:
    """A GGUF file worth offering: it is a readable file that starts as GGUF does."""
    problem = gguf_file_problem(path)
    if problem is None:
        try:
            size = path.stat().st_size
        except OSError as exc:
            problem = f"unreadable ({exc.strerror or exc})"
    if problem is not None:
        return Skipped(path, problem)
    return FoundModel(_library_name(name), label, source, GGUF, path, size)


def gguf_file_problem(path: Path) -> str | None:
    """Why `path` is no GGUF file to import (None: a regular file that begins as every
    GGUF file does; the importer checks the rest), in words that follow its name ("x.gguf
    is …"). Opened without waiting: a pipe named .gguf would wait for a writer forever."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return "missing (or a link to nowhere)"
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "not a regular file"
        magic = os.read(fd, len(_GGUF_MAGIC))
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    finally:
        os.close(fd)
    return None if magic == _GGUF_MAGIC else "not a GGUF file"


def _is_text(name: str) -> bool:
    """Whether a file name is text (bytes that are not UTF-8 come as lone surrogates,
    which do not survive the window's strings)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _mlx_item(folder: Path, label: str, name: str, source: str) -> Item:
    try:
        problem = mlx_folder_problem(folder)
        size = folder_size(folder) if problem is None else 0
    except OSError as exc:
        problem = f"could not be read ({exc.strerror or exc})"
    if problem:
        return Skipped(folder, problem)
    return FoundModel(_library_name(name), label, source, MLX, folder, size)


def _library_name(name: str) -> str:
    """A name the library accepts (one visible folder name)."""
    cleaned = name.replace("/", "-").replace("\\", "-").lstrip(".")
    return cleaned or "model"


def _ollama(root: Path, budget: _Budget) -> Iterator[Item]:
    """manifests/<host>/<namespace>/<model>/<tag>: JSON naming the GGUF blob by digest."""
    manifests = root / "manifests"
    if not _is_folder(manifests):
        return
    yield from _ollama_level(root, manifests, (), budget)


def _ollama_level(
    root: Path, folder: Path, parts: tuple[str, ...], budget: _Budget
) -> Iterator[Item]:
    for entry in _entries(folder, budget):
        path = Path(entry.path)
        if entry.name.startswith("."):
            continue
        try:
            is_folder = entry.is_dir(follow_symlinks=False)
        except OSError:
            continue
        if len(parts) < 3 and is_folder:
            try:
                yield from _ollama_level(root, path, (*parts, entry.name), budget)
            except OSError as exc:
                yield Skipped(path, f"could not be read ({exc.strerror or exc})")
        elif len(parts) == 3 and not is_folder:
            yield _ollama_manifest(root, path, (*parts, entry.name))


def _ollama_manifest(root: Path, manifest: Path, parts: tuple[str, ...]) -> Item:
    host, namespace, model, tag = parts
    # Ollama's own short names: library models bare, others with their namespace (and host).
    owner = [] if (host, namespace) == _OLLAMA_LIBRARY else [namespace]
    owner = owner if host == _OLLAMA_LIBRARY[0] else [host, namespace]
    label = "/".join([*owner, f"{model}:{tag}"])
    try:
        if not manifest.is_file():
            return Skipped(manifest, "manifest is not a regular file")
        if manifest.stat().st_size > _MAX_MANIFEST_BYTES:
            return Skipped(manifest, "manifest too large")
        data = json.loads(manifest.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return Skipped(manifest, f"manifest could not be read ({exc})")
    layers = data.get("layers") if isinstance(data, dict) else None
    model_layers = [
        layer
        for layer in (layers if isinstance(layers, list) else [])
        if isinstance(layer, dict) and layer.get("mediaType") == _OLLAMA_MODEL_LAYER
    ]
    if not model_layers:
        return Skipped(manifest, "manifest names no model layer")
    text = model_layers[0].get("digest")
    digest = _DIGEST.fullmatch(text) if isinstance(text, str) else None
    if digest is None:  # only hex ever becomes part of a path
        return Skipped(manifest, "manifest's model digest is not a sha256 digest")
    return _gguf_item(root / "blobs" / f"sha256-{digest[1]}", label, label, OLLAMA)


def _huggingface(root: Path, budget: _Budget) -> Iterator[Item]:
    """models--<org>--<name>/snapshots/<revision>/: the revision refs/main names, else the
    newest one."""
    for entry in _entries(root, budget):
        if not entry.name.startswith("models--"):
            continue  # datasets--, spaces--, the lock folder
        repo = entry.name[len("models--") :].split("--", 1)
        label = "/".join(repo)
        snapshot = _snapshot(Path(entry.path))
        if snapshot is None:
            yield Skipped(Path(entry.path), "no downloaded snapshot")
        else:
            yield _mlx_item(snapshot, label, repo[-1], HUGGING_FACE)


def _snapshot(repo: Path) -> Path | None:
    snapshots = repo / "snapshots"
    main = (_small_text(repo / "refs" / "main") or "").strip()
    if _REVISION.fullmatch(main) and _is_folder(snapshots / main):
        return snapshots / main
    try:
        folders = [p for p in snapshots.iterdir() if p.is_dir() and not p.is_symlink()]
        return max(folders, key=lambda p: p.stat().st_mtime, default=None)
    except OSError:
        return None


def _mark_installed(found: list[FoundModel], installed: list[ModelInfo]) -> list[FoundModel]:
    """A found model the library has already: a link to its folder, a GGUF file it was
    imported from (the same file name and size, whatever name the import took: first
    start names LM Studio's starter file after the model), or its name taken."""
    by_folder = {str(m.in_place): m.name for m in installed if m.in_place}
    names = {m.name for m in installed}
    marked = []
    for item in found:
        if item.kind == MLX:
            name = by_folder.get(str(item.path.resolve()), "")
        else:
            name = imported_as(item.path.name, item.size_bytes, installed)
        name = name or (item.name if item.name in names else "")
        marked.append(replace(item, installed_as=name) if name else item)
    return marked


def imported_as(file_name: str, size: int, installed: list[ModelInfo]) -> str:
    """The library name of the model imported from a GGUF file of this name and size;
    "" for none."""
    for model in installed:
        if model.gguf == (file_name, size):
            return model.name
    return ""


def find(name: str, discovery: Discovery) -> FoundModel | None:
    """The found model called `name` (its library name or its label)."""
    for item in discovery.found:
        if name in (item.name, item.label):
            return item
    return None
