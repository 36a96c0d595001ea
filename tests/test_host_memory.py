"""On Linux the engine has glibc keep freed memory for reuse: mlx's CPU build frees
every array to the C library, and memory that went back to the OS is mapped again
page by page on its next use (most of a restore's time on this VM)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]

# Bytes glibc holds in blocks of their own mapping (mallinfo2's hblkhd), before and
# after an 8 MB mlx array: a block of its own goes back to the OS when freed.
MAPPED_APART = """
import ctypes
import app.engine
import mlx.core as mx

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
before = libc.mallinfo2().hblkhd
array = mx.zeros((2 << 20,), mx.float32)
mx.eval(array)
print(libc.mallinfo2().hblkhd - before)
"""


def mapped_apart(**env_extra: str) -> int:
    env = {key: value for key, value in os.environ.items() if key != "REPRISE_HOST_MEMORY"}
    done = subprocess.run(
        [sys.executable, "-c", MAPPED_APART],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, **env_extra},
        check=True,
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")
def test_an_array_of_megabytes_comes_from_memory_kept_for_reuse():
    assert mapped_apart() == 0
    assert mapped_apart(REPRISE_HOST_MEMORY="system") >= 8 << 20  # glibc's own choice
