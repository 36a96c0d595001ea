"""Cache files on disk: contained URLs, atomic writes, checked reads (docs/architecture.md §5).

This module knows files and bytes, not models: tensors arrive and leave as
numpy arrays (or the engine's own arrays) with string metadata.

- Contained: a stored `file://` URL is only opened if it resolves inside the
  cache root; NUL bytes, over-long names, symlink loops, folders and other
  non-files where a file should be are rejections, never exceptions.
- Checked: the header is parsed and checked by our own code before any loader
  sees the file (`safetensors_header`); the metadata carries a format version
  and the caller's expectations; one checksum covers header and data. Any
  problem raises `CacheRejected` with a reason.
- Atomic: written to a temporary file in the same folder (its name carries the
  writer's pid, so start-up repair knows a dead writer's leftovers), fsynced,
  renamed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import BinaryIO
from urllib.parse import unquote, urlparse

import numpy as np

from sessions import paths
from sessions.errors import CacheRejected, CacheUnreadable, DiskFull, storage_errors
from sessions.safetensors_header import (
    CHECKSUM_KEY,
    DTYPES,
    Header,
    as_bytes,
    check_expected,
    digest,
    dtype_code,
    encode_header,
    layout,
    parse_header,
)

# 4: a chunk stacks alike layers into one tensor per part ("0-29.k.0"; the engine's
# app/engine/layer_runs.py). 3 files are still read: their layout is one of 4's.
# 3: a float32 cache of a 16-bit model is stored in 16 bits (its kv_format says which).
# 2: our own header checks, and one xxh3 checksum over header and data (1 was a CRC-32 of
# the tensor bytes only). A file of another version is rejected, and the turn recomputes.
FORMAT_VERSION = "4"
READABLE_VERSIONS = ("3", "4")
FORMAT_KEY = "reprise.format"
TMP_PREFIX = ".tmp-"
_TMP_NAME = re.compile(r"\.tmp-(\d+)-.+")
# A temp file this old is a leftover even if a process with its writer's pid runs now.
STALE_TEMP_SECONDS = 10 * 60
MAX_URL = 4096
_MAX_NAME_BYTES = 255

Loader = Callable[[Path], tuple[dict, dict[str, str]]]


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")


def kv_root() -> Path:
    with storage_errors(paths.cache_dir()):
        root = paths.cache_dir() / "kv"
        root.mkdir(parents=True, exist_ok=True)
    return root


def path_from_url(url: object, root: Path | None = None) -> Path:
    """The file a stored URL names, refused unless it is a file:// URL inside the cache root."""
    return paths_from_urls([url], root)[0]


def paths_from_urls(urls: list, root: Path | None = None) -> list[Path]:
    """`path_from_url` for each of `urls`, the root resolved once (a restore checks a
    file per 256 tokens)."""
    resolved = (root or kv_root()).resolve()
    return [_inside(url, resolved) for url in urls]


def _inside(url: object, root: Path) -> Path:
    if not isinstance(url, str):
        raise CacheRejected("the stored URL is not text")
    shown = url[:120]
    if len(url) > MAX_URL:
        raise CacheRejected(f"the stored URL is too long ({len(url)} characters)")
    try:
        parsed = urlparse(url)
    except ValueError:
        raise CacheRejected(f"not a local file URL: {shown}") from None
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost"):
        raise CacheRejected(f"not a local file URL: {shown}")
    if parsed.params or parsed.query or parsed.fragment:
        raise CacheRejected(f"not a plain file URL: {shown}")
    raw = unquote(parsed.path)
    if "\x00" in raw:
        raise CacheRejected("a NUL byte in the stored URL")
    if any(
        len(part.encode("utf-8", "surrogateescape")) > _MAX_NAME_BYTES for part in raw.split("/")
    ):
        raise CacheRejected("a name in the stored URL is too long")
    try:
        path = Path(raw).resolve()
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop
        raise CacheRejected(f"the stored URL cannot be followed ({exc})") from None
    if not path.is_relative_to(root):
        raise CacheRejected(f"outside the cache folder: {shown}")
    return path


def temp_path(path: Path) -> Path:
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{path.name}")


def is_stale_temp(path: Path, max_age: float = STALE_TEMP_SECONDS) -> bool:
    """Whether `path` is a temp file of ours whose writer is gone (or that is very old)."""
    match = _TMP_NAME.fullmatch(path.name)
    if not match:
        return False
    try:
        age = time.time() - path.lstat().st_mtime
    except OSError:
        return False
    return age > max_age or not _pid_alive(int(match[1]))


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def write_file(path: Path, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> int:
    """Write a cache file atomically; return its size."""
    # A strided view must be compacted before its buffer is written.
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    meta = {k: v for k, v in metadata.items() if k not in (CHECKSUM_KEY, FORMAT_KEY)}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise TypeError("cache file metadata must be text")
    meta[FORMAT_KEY] = FORMAT_VERSION
    specs = layout(arrays)
    meta[CHECKSUM_KEY] = digest(specs, meta, (as_bytes(arrays[t.name]) for t in specs))
    header = encode_header(specs, meta)
    tmp = temp_path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(header)
            for spec in specs:
                f.write(as_bytes(arrays[spec.name]))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(
                f"The disk is full; the conversation's cache was not saved ({path.parent})"
            ) from exc
        if exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            message = f"the cache folder {path.parent} is read-only; the cache was not saved"
        else:
            message = f"the cache file {path.name} could not be written: {exc.strerror or exc}"
        raise OSError(exc.errno, message[0].upper() + message[1:]) from exc
    _fsync_dir(path.parent)
    return len(header) + sum(a.nbytes for a in arrays.values())


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_numpy(path: Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read a cache file into numpy arrays with our own reader (no native parser)."""
    with _open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        header = parse_header(f, size)
        return _read_arrays(f, header)[0], header.metadata


def read_file(
    path: Path,
    expect: Mapping[str, str],
    load: Loader = load_numpy,
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    size: int | None = None,
) -> tuple[dict, dict[str, str]]:
    """Read and check a cache file.

    `expect`: metadata that must match exactly. `shapes`: if given, the exact tensor
    names and shapes the file must hold; `size`: if given, the file's size in bytes.
    Both are checked from the header, before any data is read. `load` reads the
    tensors; the engine passes one that reads straight into its own arrays (any
    array type numpy can view through the buffer protocol works).
    """
    with _open_regular(path) as f:
        file_size = os.fstat(f.fileno()).st_size
        header = parse_header(f, file_size)
        _check_metadata(header.metadata, expect)
        check_expected(header, shapes, size, file_size)
        if load is load_numpy:  # the file is open already: read it from here
            tensors, data = _read_arrays(f, header)
        else:
            tensors = _load_with(load, path, header)
            data = (as_bytes(tensors[t.name]) for t in header.tensors)
        if digest(header.tensors, header.metadata, data) != header.metadata.get(CHECKSUM_KEY):
            raise CacheRejected("checksum mismatch (damaged file)")
    return tensors, header.metadata


def read_ahead(paths: list[Path]) -> None:
    """Have the OS read `paths` into its page cache while the caller goes on, so that
    the disk reads the next files while the first are checked and joined. Only a hint
    (posix_fadvise is Linux's; elsewhere nothing happens), given on a thread of its
    own: asking for a file's pages can take a while before it returns."""
    if hasattr(os, "posix_fadvise"):
        threading.Thread(target=advise_reading, args=(list(paths),), daemon=True).start()


def advise_reading(paths: list[Path]) -> None:
    """`read_ahead`'s hint itself: each path opened as any cache file is (a regular
    file, never waiting on a FIFO, no symlink followed), what cannot be is skipped."""
    for path in paths:
        try:
            with _open_regular(path) as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
        except (CacheRejected, OSError, AttributeError):  # AttributeError: no posix_fadvise
            continue


@contextlib.contextmanager
def _open_regular(path: Path) -> Iterator[BinaryIO]:
    # Non-blocking: opening a FIFO planted where a file should be must not hang.
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CacheRejected("file missing") from None
    except ValueError:
        raise CacheRejected("a NUL byte in the file name") from None
    except OSError as exc:
        reasons = {
            errno.ELOOP: "a symlink where the file should be",
            errno.ENAMETOOLONG: "name too long",
        }
        if exc.errno in reasons:
            raise CacheRejected(reasons[exc.errno]) from None
        raise CacheUnreadable(f"unreadable file ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a folder" if stat.S_ISDIR(mode) else "something that is not a file"
        raise CacheRejected(f"{what} where the file should be")
    with open(fd, "rb") as f:
        try:
            yield f
        except OSError as exc:
            raise CacheUnreadable(f"unreadable file ({exc.strerror or exc})") from None


def _check_metadata(metadata: Mapping[str, str], expect: Mapping[str, str]) -> None:
    if metadata.get(FORMAT_KEY) not in READABLE_VERSIONS:
        raise CacheRejected("not a Reprise cache file of this version")
    for key, value in expect.items():
        if metadata.get(key) != value:
            raise CacheRejected(f"{key} does not match")


def _read_arrays(f: BinaryIO, header: Header) -> tuple[dict[str, np.ndarray], list]:
    """All tensors as views of one buffer filled straight from the file."""
    buffer = np.empty(header.data_bytes, dtype=np.uint8)
    f.seek(header.data_start)
    view, filled = memoryview(buffer), 0
    while filled < header.data_bytes:
        got = f.readinto(view[filled:])
        if not got:
            raise CacheRejected("unreadable file (shorter than its header says)")
        filled += got
    tensors = {
        t.name: buffer[t.begin : t.end].view(DTYPES[t.dtype]).reshape(t.shape)
        for t in header.tensors
    }
    return tensors, [buffer]


def _load_with(load: Loader, path: Path, header: Header) -> dict:
    try:
        tensors, _ = load(path)
    except Exception as exc:  # the caller's loader: whatever it raises, the file is unusable
        raise CacheRejected(f"unreadable file ({exc})") from exc
    if set(tensors) != {t.name for t in header.tensors}:
        raise CacheRejected("unreadable file (the loader saw other tensors)")
    for spec in header.tensors:
        array = tensors[spec.name]
        if dtype_code(array.dtype) != spec.dtype or tuple(array.shape) != spec.shape:
            raise CacheRejected(f"unreadable file (the loader saw {spec.name} differently)")
    return tensors


def file_format(path: Path) -> str | None:
    """The format version a cache file declares, from its header alone; None when
    the file is not a readable cache file."""
    try:
        with _open_regular(path) as f:
            return parse_header(f, os.fstat(f.fileno()).st_size).metadata.get(FORMAT_KEY)
    except CacheRejected:
        return None


def tensor_names(path: Path) -> set[str] | None:
    """The names of the tensors a cache file holds, from its header alone; None when
    the file is not a readable cache file."""
    try:
        with _open_regular(path) as f:
            header = parse_header(f, os.fstat(f.fileno()).st_size)
    except CacheRejected:
        return None
    return {tensor.name for tensor in header.tensors}
