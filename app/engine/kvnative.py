"""The compiled products of the CPU path's packed-cache attention (kvdecode.c).

kvcpu calls `scores` and `values` for one KV head at a time on numpy views of
the cache's own buffers. Every pointer and stride handed to C is taken from a
numpy array here, after the checks in `fits`, so the library reads only what
those arrays hold. Where the library was not built (no C compiler at install)
or `REPRISE_KV_NATIVE=off`, `available()` is False and kvcpu keeps its numpy code.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

_INT, _SIZE, _FLOAT_P, _P = ctypes.c_int, ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_void_p
_ROWS = [_P, _SIZE, _P, _P, _SIZE, _INT, _INT, _INT, _INT]  # a store's rows, as in the C

enabled = os.environ.get("REPRISE_KV_NATIVE", "on") != "off"
_library: ctypes.CDLL | None = None
_tried = False


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if not _tried:
        _tried = True
        try:
            from app.engine import _kvdecode
        except ImportError:
            return None
        library = ctypes.CDLL(_kvdecode.__file__)
        library.reprise_kv_scores.argtypes = [*_ROWS, _FLOAT_P, _INT, _FLOAT_P, _SIZE]
        library.reprise_kv_values.argtypes = [*_ROWS, _FLOAT_P, _SIZE, _INT, _FLOAT_P]
        library.reprise_kv_scores.restype = library.reprise_kv_values.restype = None
        library.reprise_kv_limit.argtypes, library.reprise_kv_limit.restype = [_INT], _INT
        _library = library
    return _library


def available() -> bool:
    return enabled and _load() is not None


class Rows:
    """One store's tokens of every KV head, as the C reads them: `parts` are numpy
    views (heads, tokens, width) of its codes, scales and biases (quantized), or of
    its float16 rows."""

    def __init__(self, bits: int | None, parts: list[np.ndarray]) -> None:
        self.bits = bits or 16
        self.codes = parts[0]
        self.scales, self.biases = (parts[1], parts[2]) if bits else (None, None)
        self.groups = 1 if bits is None else parts[1].shape[-1]
        self.dim = self.codes.shape[-1] * self.codes.itemsize * 8 // self.bits
        self.tokens = self.codes.shape[1]

    def fits(self, queries: int) -> bool:
        """Whether the C takes these rows: its limits, whole lanes per group, and each
        token's codes (and scales) contiguous, biases laid out as the scales."""
        library = _load()
        if library is None:
            return False
        limit = library.reprise_kv_limit
        size = self.dim // self.groups
        shapes_fit = (
            self.dim <= limit(0)
            and queries <= limit(1)
            and self.groups <= limit(2)
            and size % limit(3) == 0
            and self.dim % self.groups == 0
        )
        codes = self.codes
        typed = codes.dtype == (np.float16 if self.bits == 16 else np.uint32)
        laid_out = (
            typed
            and codes.strides[-1] == codes.itemsize
            and (
                self.scales is None
                or (
                    self.scales.dtype == self.biases.dtype == np.float16
                    and self.scales.shape == self.biases.shape == (*codes.shape[:2], self.groups)
                    and self.scales.strides == self.biases.strides
                    and self.scales.strides[-1] == 2
                )
            )
        )
        return shapes_fit and laid_out

    def _arguments(self, head: int) -> list:
        scales = (None, None, 0) if self.scales is None else (
            self.scales[head].ctypes.data,
            self.biases[head].ctypes.data,
            self.scales.strides[1] // 2,
        )  # fmt: skip
        return [
            self.codes[head].ctypes.data, self.codes.strides[1], *scales,
            self.tokens, self.dim, self.bits, self.groups,
        ]  # fmt: skip


def scores(rows: Rows, head: int, q: np.ndarray, out: np.ndarray) -> None:
    """out = q @ rowsᵀ for KV head `head`: q (queries, dim) contiguous float32, out
    (queries, tokens) float32 with contiguous rows."""
    _require(q.dtype == out.dtype == np.float32 and q.flags.c_contiguous)
    _require(out.strides[-1] == 4 and out.shape == (len(q), rows.tokens) and q.shape[1] == rows.dim)
    _load().reprise_kv_scores(
        *rows._arguments(head), q.ctypes.data, len(q), out.ctypes.data, out.strides[0] // 4
    )


def values(rows: Rows, head: int, w: np.ndarray, out: np.ndarray) -> None:
    """out += w @ rows for KV head `head`: w (queries, tokens) float32 with contiguous
    rows, out (queries, dim) contiguous float32."""
    _require(w.dtype == out.dtype == np.float32 and w.strides[-1] == 4)
    _require(w.shape[1] == rows.tokens and out.flags.c_contiguous)
    _require(out.shape == (len(w), rows.dim))
    _load().reprise_kv_values(
        *rows._arguments(head), w.ctypes.data, w.strides[0] // 4, len(w), out.ctypes.data
    )


def _require(condition: bool) -> None:
    """The C reads what the arrays' shapes say: a mismatch is a bug, never read past."""
    if not condition:
        raise ValueError("arrays do not fit the packed-cache products")
