"""Download an MLX model from the Hugging Face hub, with progress and cancel.

huggingface_hub lists the repository and builds the file URLs (and the auth
headers, when the user is logged in); the bytes are streamed here in blocks
so that progress is reported and Cancel is honoured between blocks. Like the
GGUF import, the folder is assembled under a hidden name and renamed into
place only when every file is complete.
"""

from __future__ import annotations

import fnmatch
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.utils import HFValidationError, build_hf_headers, validate_repo_id

from app.engine.errors import UserError
from app.engine.models import staged_folder

# What mlx-lm needs to load a model, and nothing else: no PyTorch or GGUF copies, and
# no custom Python code.
WANTED = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
BLOCK = 1 << 20
# What a download reads at a time, at most: what has arrived (`read1`), so that Cancel is
# heard between pieces on a slow line too, not once a whole block has come.
PIECE = 64 << 10

Progress = Callable[[int, int, str], None]  # bytes done, bytes in all, current file


class DownloadError(UserError):
    pass


class DownloadCancelled(UserError):
    def __init__(self) -> None:
        super().__init__("The download was cancelled; nothing was kept.")


def _wanted(name: str) -> bool:
    return "/" not in name and any(fnmatch.fnmatch(name, p) for p in WANTED)


def hub_endpoint() -> str | None:
    """A mirror or a test server, from REPRISE_HF_ENDPOINT; None means huggingface.co."""
    return os.environ.get("REPRISE_HF_ENDPOINT") or None


# What a user may paste instead of the name: the address of the model's page.
_HUB_PAGE = re.compile(r"^(?:https?://)?(?:www\.)?(?:huggingface\.co|hf\.co)/([^?#]*)", re.I)
_NOT_MODELS = {"datasets": "a dataset", "spaces": "a Space"}  # pages of other things
QUOTED = 60  # characters of what was typed that an error repeats


def repo_id_of(text: str) -> str:
    """The hub's name of a model ("owner/name") from what the user typed: the name, or
    the address of its page; a clear error for anything else, before the hub is asked."""
    typed = text.strip()
    shown = typed if len(typed) <= QUOTED else typed[: QUOTED - 1] + "…"
    repo_id = typed
    page = _HUB_PAGE.match(typed)
    if page:
        parts = [part for part in page.group(1).split("/") if part]
        if parts and parts[0] in _NOT_MODELS:
            raise DownloadError(f"{shown!r} is {_NOT_MODELS[parts[0]]}, not a model")
        repo_id = "/".join(parts[:2])
    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise DownloadError(
            f"{shown!r} is not a model's name on the hub: it looks like owner/name, "
            "such as mlx-community/Qwen3-1.7B-4bit (letters, digits, '-', '_' and '.')"
        ) from None
    return repo_id


def download_model(
    repo_id: str,
    models_dir: Path,
    name: str | None = None,
    endpoint: str | None = None,
    progress: Progress | None = None,
    should_cancel: Callable[[], bool] = lambda: False,
) -> Path:
    report = progress or (lambda done, total, file: None)
    repo_id = repo_id_of(repo_id)
    name = name or repo_id.rsplit("/", 1)[-1]
    target = models_dir / name
    if target.exists():
        raise DownloadError(f"A model named {name!r} already exists in {models_dir}")
    try:
        info = HfApi(endpoint=endpoint).model_info(repo_id, files_metadata=True)
    except RepositoryNotFoundError as exc:
        raise DownloadError(f"No model {repo_id!r} on the hub (or it is private)") from exc
    except Exception as exc:  # HfHubHTTPError, OSError, or the HTTP client's own errors
        raise DownloadError(_unreachable(repo_id, endpoint, exc)) from exc
    files = [(s.rfilename, s.size or 0) for s in info.siblings or [] if _wanted(s.rfilename)]
    names = {f for f, _ in files}
    if "config.json" not in names or not any(f.endswith(".safetensors") for f in names):
        raise DownloadError(
            f"{repo_id} is not an MLX model (it needs config.json and .safetensors weights); "
            "mlx-community on the hub has converted ones"
        )
    total = sum(size for _, size in files)
    done = 0
    with staged_folder(models_dir, name, "download") as staging:
        headers = build_hf_headers()
        for filename, size in files:
            url = hf_hub_url(repo_id, filename, revision=info.sha, endpoint=endpoint)
            done = _fetch(
                url, headers, staging / filename, size, done, total, report, should_cancel
            )
    report(total, total, "")
    return target


def _unreachable(repo_id: str, endpoint: str | None, exc: BaseException) -> str:
    """Why the hub did not answer, in words (found on a new-user walk: "[Errno -2] Name
    or service not known" was all it said, with no machine online)."""
    host = _host(endpoint or "https://huggingface.co")
    cause = _innermost(exc)
    if isinstance(cause, OSError):  # no network, no name lookup, refused, timed out
        detail = cause.strerror or str(cause)
        return (
            f"Could not reach the hub ({host}) for {repo_id!r}: no connection ({detail}). "
            "Check this computer's internet connection, then try again."
        )
    return f"Could not reach the hub ({host}) for {repo_id!r}: {exc}"


def _host(endpoint: str) -> str:
    """The endpoint's host (and port), never its user or password."""
    try:
        parts = urllib.parse.urlsplit(endpoint)
        host, port = parts.hostname, parts.port
    except ValueError:
        return "the hub's address is not valid"
    if not host:
        return "no host in its address"
    return f"{host}:{port}" if port else host


def _innermost(exc: BaseException) -> BaseException:
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc


def _fetch(
    url: str,
    headers: dict,
    path: Path,
    size: int,
    done: int,
    total: int,
    report: Progress,
    should_cancel: Callable[[], bool],
) -> int:
    request = urllib.request.Request(url, headers=headers)
    written = 0
    try:
        with urllib.request.urlopen(request, timeout=60) as response, path.open("wb") as out:
            while block := response.read1(PIECE):
                if should_cancel():
                    raise DownloadCancelled()
                out.write(block)
                before, written = written, written + len(block)
                if before // BLOCK != written // BLOCK:  # a report a MiB, not a piece
                    report(done + written, total, path.name)
    except urllib.error.URLError as exc:
        raise DownloadError(f"Downloading {path.name} failed: {exc}") from exc
    if size and written != size:
        raise DownloadError(f"{path.name} arrived incomplete ({written} of {size} bytes)")
    report(done + written, total, path.name)
    return done + written
