"""Give mlx's Linux CPU build a fast BLAS.

The `mlx[cpu]` wheel for Linux links a reference BLAS (about 5 GFLOP/s for a
1024x1024 float32 matmul here). Loading OpenBLAS into the global symbol
namespace before mlx is first imported makes mlx's `cblas_sgemm` resolve to
it (about 160 GFLOP/s), with no re-exec and no LD_PRELOAD. This module must be
imported before anything imports mlx; `app.engine` does so first thing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasChoice:
    name: str  # "openblas", "accelerate", "reference"
    path: str | None
    note: str


def _find_openblas() -> str | None:
    override = os.environ.get("REPRISE_OPENBLAS")
    if override:
        return override if Path(override).exists() else None
    for candidate in _CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return ctypes.util.find_library("openblas")


def preload() -> BlasChoice:
    """Load OpenBLAS globally on Linux, if present and mlx is not imported yet."""
    if platform.system() == "Darwin":
        return BlasChoice("accelerate", None, "mlx on macOS uses Accelerate and Metal")
    if os.environ.get("REPRISE_OPENBLAS") == "off":
        return BlasChoice("reference", None, "OpenBLAS disabled by REPRISE_OPENBLAS=off")
    path = _find_openblas()
    if path is None:
        return BlasChoice(
            "reference", None, "OpenBLAS not found (Debian: apt-get install libopenblas0)"
        )
    if "mlx.core" in sys.modules:
        return BlasChoice("reference", None, "mlx was imported before OpenBLAS could be loaded")
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return BlasChoice("reference", None, f"OpenBLAS at {path} failed to load: {exc}")
    return BlasChoice("openblas", path, f"OpenBLAS preloaded from {path}")


CHOICE = preload()
