"""Download an MLX model from the Hugging Face hub, with progress and cancel.

huggingface_hub lists the repository and builds the file URLs (and the auth
headers, when the user is logged in); the bytes are streamed here in blocks
so that progress is reported and Cancel is honoured between blocks. Like the
GGUF import, the folder is assembled under a hidden name and renamed into
place only when every file is complete.
"""

from __future__ import annotations

import fnmatch
import http.client
import os
import re
import shutil
import urllib.error
import urllib.parse
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import HfApi, hf_hub_url
from huggingface_hub.errors import RepositoryNotFoundError
from huggingface_hub.utils import HFValidationError, build_hf_headers, validate_repo_id

from app.engine.incoming import (  # noqa: F401  (the errors are this module's too)
    BLOCK,
    PIECE,
    READ_TIMEOUT_S,
    DownloadCancelled,
    DownloadError,
    Incoming,
    Progress,
    save,
)
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
# Disk space a download leaves free: the system and the app's own files need some too.
RESERVE_BYTES = 1 << 30


def _wanted(name: object) -> bool:
    """A file the model needs, named as a plain file in the model's folder (the listing
    is the hub's word, untrusted: no folders, nothing hidden, nothing the disk cannot
    name)."""
    return (
        isinstance(name, str)
        and name.isprintable()  # no line ends, no bidi overrides
        and not any(c in name for c in "/\\")
        and not name.startswith(".")
        and 0 < len(_utf8(name)) <= 255
        and any(fnmatch.fnmatch(name, p) for p in WANTED)
    )


def _utf8(name: str) -> bytes:
    """The name as a file system and a URL take it; nothing for a lone surrogate."""
    try:
        return name.encode("utf-8")
    except UnicodeEncodeError:
        return b""


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
    if target.is_symlink() or target.exists():  # a link to a folder gone is a name taken
        raise DownloadError(f"A model named {name!r} already exists in {models_dir}")
    info = _listing(repo_id, endpoint, should_cancel)
    files = _files(info, repo_id, endpoint)
    names = {f for f, _ in files}
    if "config.json" not in names or not any(f.endswith(".safetensors") for f in names):
        raise DownloadError(
            f"{repo_id} is not an MLX model (it needs config.json and .safetensors weights); "
            "mlx-community on the hub has converted ones"
        )
    total = sum(size for _, size in files)
    done = unlisted = 0
    with staged_folder(models_dir, name, "download") as staging:
        spare = _room(staging, total) - total  # what files with no size listed may fill
        headers = build_hf_headers()
        for filename, size in files:
            incoming = Incoming(
                hf_hub_url(repo_id, filename, revision=info.sha, endpoint=endpoint),
                filename,
                said=size,
                cap=size or max(spare - unlisted, 0),
                headers=headers,
            )
            written = save(
                incoming,
                staging / filename,
                lambda exc, f=filename: _lost(f, repo_id, endpoint, exc),
                # Never past the total: files with no size listed are not in it.
                lambda n, before=done, f=filename: report(before + n, max(total, before + n), f),
                should_cancel,
            )
            done, unlisted = done + written, unlisted + (0 if size else written)
    report(done, max(total, done), "")
    return target


def _listing(repo_id: str, endpoint: str | None, should_cancel: Callable[[], bool]):
    """The hub's word on the repository: its files, their sizes, and the revision they
    are at (40 hex digits, as it goes into each file's address)."""
    try:
        info = HfApi(endpoint=endpoint).model_info(
            repo_id, files_metadata=True, timeout=READ_TIMEOUT_S
        )
    except RepositoryNotFoundError as exc:
        raise DownloadError(f"No model {repo_id!r} on the hub (or it is private)") from exc
    except UNREADABLE as exc:  # it answered, with something that is not a listing
        raise DownloadError(_unreadable(repo_id, endpoint)) from exc
    except Exception as exc:  # HfHubHTTPError, OSError, or the HTTP client's own errors
        if should_cancel():
            raise DownloadCancelled() from exc
        raise DownloadError(_unreachable(repo_id, endpoint, exc)) from exc
    if should_cancel():  # the listing can take a while to come
        raise DownloadCancelled()
    if not (isinstance(info.sha, str) and re.fullmatch(r"[0-9a-f]{40}", info.sha)):
        raise DownloadError(_unreadable(repo_id, endpoint))
    return info


LARGEST = 1 << 50  # bytes: no file of a model is a petabyte (10**400 overflowed a float)

# What a listing of the wrong shape raises, as parsed (a review sent names as numbers,
# sizes as text, nesting past Python's recursion limit).
UNREADABLE = (TypeError, ValueError, KeyError, AttributeError, RecursionError, OverflowError)


def _unreadable(repo_id: str, endpoint: str | None) -> str:
    host = _host(endpoint)
    return (
        f"The hub ({host}) answered, but its list of {repo_id!r}'s files could not be "
        "read: nothing was downloaded. Try again later."
    )


def _files(info, repo_id: str, endpoint: str | None) -> list[tuple[str, int]]:
    """The wanted files and their listed sizes (0: none listed). A size that is not a
    count of bytes, or a name listed twice, is a damaged listing: sizes are what cap the
    download, and a NaN or a negative one undid the cap (a review)."""
    files: dict[str, int] = {}
    for sibling in info.siblings or []:
        name, size = getattr(sibling, "rfilename", None), getattr(sibling, "size", None)
        if not _wanted(name):
            continue
        if name in files or not (size is None or (type(size) is int and 0 <= size < LARGEST)):
            raise DownloadError(_unreadable(repo_id, endpoint))
        files[name] = size or 0
    return list(files.items())


def _room(folder: Path, total: int) -> int:
    """The bytes a download may write in `folder`: the disk's free space less a reserve;
    a download that does not fit is refused before its first byte."""
    room = shutil.disk_usage(folder).free - RESERVE_BYTES
    if total > room:
        raise DownloadError(
            f"Not enough disk space for this model: it needs {_gb(total)}, and "
            f"{_gb(max(room, 0))} can be spared in {folder.parent}. Free some space, "
            "then try again."
        )
    return room


def _gb(count: int) -> str:
    return f"{count / 1e9:.1f} GB"


def _lost(filename: str, repo_id: str, endpoint: str | None, exc: BaseException) -> str:
    """Why a file did not come, in words (a stalled line used to be "a bug")."""
    host = _host(endpoint)
    if isinstance(exc, urllib.error.HTTPError):
        return f"Downloading {filename} failed: {host} answered {exc.code} ({exc.reason})."
    if isinstance(exc, http.client.HTTPException):  # closed mid-file, or not HTTP at all
        return f"Downloading {filename} failed: the connection to {host} broke off. Try again."
    return f"Downloading {filename} failed. {_unreachable(repo_id, endpoint, exc)}"


def _unreachable(repo_id: str, endpoint: str | None, exc: BaseException) -> str:
    """Why the hub did not answer, in words (found on a new-user walk: "[Errno -2] Name
    or service not known" was all it said, with no machine online)."""
    host = _host(endpoint)
    cause = _innermost(exc)
    if isinstance(cause, OSError):  # no network, no name lookup, refused, timed out
        detail = cause.strerror or str(cause)
        return (
            f"Could not reach the hub ({host}) for {repo_id!r}: no connection ({detail}). "
            "Check this computer's internet connection, then try again."
        )
    return f"Could not reach the hub ({host}) for {repo_id!r}: {exc}"


def _host(endpoint: str | None) -> str:
    """The endpoint's host (and port), never its user or password; None is the hub's."""
    try:
        parts = urllib.parse.urlsplit(endpoint or "https://huggingface.co")
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
