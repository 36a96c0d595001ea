"""Freed memory kept for reuse, where the C library is glibc (Linux).

Why: mlx's CPU build takes every array's memory from malloc and gives it back
on free (its Metal build keeps freed buffers in a cache of its own). glibc
returns large blocks to the OS: any block over its mmap threshold (which
starts at 128 KB and only rises as such blocks are freed), and the free top of
its heap past 128 KB. The next array of that size is then fresh memory, which
the kernel maps a 4 KB page at a time as it is first written. A restore writes
a whole cache into new buffers, so it paid that on every byte: repeated 4k-token
restores (95 MB of float16 rows) took 60 ms each on this VM with glibc's
defaults and 22 ms with the memory coming back from the heap (README).

How: at engine import, blocks up to 32 MB (glibc's largest threshold) come
from the heap, and up to `KEEP_BYTES` of free memory at its top stays mapped
(glibc trims past that, as before past 128 KB): the same bytes serve the next
restore or turn. `REPRISE_HOST_MEMORY=system` keeps glibc's defaults (benches
compare the two). Elsewhere (macOS, musl) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
MMAP_THRESHOLD = 32 << 20
KEEP_BYTES = 256 << 20

enabled = os.environ.get("REPRISE_HOST_MEMORY", "keep") != "system"


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def keep_freed_memory() -> bool:
    """glibc's thresholds set as above; False where nothing was changed."""
    libc = _glibc() if enabled else None
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mapped = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    kept = libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES)
    return bool(mapped and kept)


kept = keep_freed_memory()
