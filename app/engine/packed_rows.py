"""One row through a layer's weights as stored, packed 4 or 8 bits (packed_rows.c).

The CPU path dequantizes a quantized model to float32 at load (`loading`), for
prefill: products of many rows, fast in float32 BLAS. A decode step multiplies
one row by every weight once, so it is bound by the bytes it reads: the
starter's 540 MB a step in float32, 75 MB as stored. `loading` therefore keeps
each quantized layer's codes beside its float32 weight (`PackedWeight`, on the
dense layer as `packed_weight`), and the one-row products (`cpu_blas.row_product`)
go through `product`.

Only mlx's affine quantization at 4 or 8 bits, groups of a multiple of 8, is
read here; anything else keeps the float32 product. So does a CPU where the
library's AVX2 build does not run (`faster_here`: its portable build is slower
than sgemv), unless `REPRISE_PACKED_ROWS=on`; `REPRISE_PACKED_ROWS=off` keeps it
for all (benches compare the two), as does a build without the library.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

_SWITCH = os.environ.get("REPRISE_PACKED_ROWS", "auto")  # "auto", "on" or "off"
enabled = _SWITCH != "off"
ABI = 4  # packed_rows.c's reprise_packed_abi()
_P, _INT = ctypes.c_void_p, ctypes.c_int
_library: ctypes.CDLL | None = None
_tried = False
_loading = threading.Lock()
# More threads than the cores this process may run on only wait for each other.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
_scratch = threading.local()  # each thread's buffer for `widened`


@dataclass(frozen=True)
class PackedWeight:
    """A (rows, columns) weight as mlx packs it: `codes` (rows, columns * bits / 32)
    uint32, `scales` and `biases` (rows, columns / group) float32."""

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int
    group: int

    def __post_init__(self) -> None:
        # The C reads what these say, and no more: nothing unchecked reaches it.
        if not _packing_read(self.bits, self.group):
            raise ValueError(f"no products of {self.bits}-bit codes in groups of {self.group}")
        if not _laid_out(self.codes, self.scales, self.biases, self.bits, self.group):
            raise ValueError("codes, scales and biases that do not describe one weight")
        # What every product passes first, worked out once (numpy's `.ctypes` takes
        # microseconds a call, and a decode step makes 211 of them).
        pointers = [_address(a) for a in (self.codes, self.scales, self.biases)]
        rows, groups = self.scales.shape
        object.__setattr__(self, "_arguments", (*pointers, rows, groups, self.group, self.bits))

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.scales.shape[1] * self.group

    def split(self, sizes: list[int]) -> list[PackedWeight]:
        """Row ranges, top to bottom (a fused projection's parts)."""
        cuts = np.cumsum(sizes)[:-1]
        parts = zip(
            *(np.split(a, cuts) for a in (self.codes, self.scales, self.biases)), strict=True
        )
        return [PackedWeight(c, s, b, self.bits, self.group) for c, s, b in parts]


def readable(module: nn.Module) -> bool:
    """Whether a quantized layer's packing is one `product` reads (affine, 4 or 8 bits,
    groups of a multiple of 8 or 32)."""
    if getattr(module, "mode", "affine") != "affine" or "biases" not in module:
        return False
    return _packing_read(module.bits, module.group_size)


def _packing_read(bits: int, group: int) -> bool:
    """4 bits in groups of a multiple of 8 values (a word each), 8 bits of 32."""
    return bits in (4, 8) and group > 0 and group % (8 if bits == 4 else 32) == 0


def of_module(module: nn.Module) -> PackedWeight | None:
    """A quantized linear or embedding layer's weight, where `product` reads it."""
    if not readable(module):
        return None
    mx.eval(module.weight, module.scales, module.biases)
    codes = _read_only(np.asarray(module.weight))  # mlx's buffer, kept alive by the view
    scales, biases = (_float32(a) for a in (module.scales, module.biases))
    if not _laid_out(codes, scales, biases, module.bits, module.group_size):
        return None
    return PackedWeight(codes, scales, biases, module.bits, module.group_size)


def _float32(array: mx.array) -> np.ndarray:
    """A read-only float32 numpy array of `array`: a view where it is float32 already
    (the codes path casts its scales at load), else a copy."""
    if array.dtype == mx.float32:
        return _read_only(np.asarray(array))
    return _read_only(np.array(array.astype(mx.float32)))


def _laid_out(codes, scales, biases, bits: int, group: int) -> bool:
    """What the C reads, and no more: a row's words hold its groups' values exactly,
    every array contiguous (the shapes come from a model's files)."""
    return (
        codes.dtype == np.uint32
        and scales.dtype == biases.dtype == np.float32
        and codes.ndim == scales.ndim == 2
        and scales.shape == biases.shape
        and codes.shape[0] == scales.shape[0]
        and codes.shape[1] * 32 == scales.shape[1] * group * bits
        and all(a.flags.c_contiguous for a in (codes, scales, biases))
    )


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def product(weight: PackedWeight, row: np.ndarray, threads: int = 1) -> np.ndarray:
    """`W @ row` for one float32 row of the weight's columns, its rows shared among
    `threads` threads (at most the cores this process may use)."""
    codes, scales, biases, rows, groups, group, bits = weight._arguments
    if row.dtype != np.float32 or not row.flags.c_contiguous:
        row = np.ascontiguousarray(row, np.float32)
    if row.shape != (groups * group,):
        raise ValueError(f"a row of {row.shape} for a weight of {weight.shape}")
    out = np.empty(rows, dtype=np.float32)
    threads = max(1, min(threads, _CORES or 1))
    done = _load().reprise_packed_gemv(
        codes, scales, biases, _address(row), rows, groups, group, bits, _address(out), threads
    )
    if not done:
        raise MemoryError("no memory for a row's scratch")
    return out


def rows_product(weight: PackedWeight, x: np.ndarray, threads: int = 1) -> np.ndarray:
    """`x @ W.T` for a few float32 rows x (n >= 2, columns) (a short turn's prompt),
    the weight's rows shared among `threads` threads, as `product` does one row."""
    codes, scales, biases, rows, groups, group, bits = weight._arguments
    x = np.ascontiguousarray(x, np.float32)
    if x.ndim != 2 or len(x) < 2 or x.shape[1] != groups * group or not many_rows_take(weight):
        raise ValueError(f"rows of {x.shape} for a weight of {weight.shape}")
    out = np.empty((len(x), rows), dtype=np.float32)
    threads = max(1, min(threads, _CORES or 1))
    done = _load().reprise_packed_rows(
        codes, scales, biases, _address(x), len(x), rows, groups, group, bits, _address(out),
        threads,
    )  # fmt: skip
    if not done:
        raise MemoryError("no memory for the rows' scratch")
    return out


def many_rows_take(weight: PackedWeight) -> bool:
    """Whether `rows_product` takes this weight (its columns in whole vectors of 16)."""
    return weight.shape[1] % 16 == 0


def many_rows_faster_here() -> bool:
    """Whether a short turn's products should read the codes (`rows_product`): the
    library's AVX-512 build runs on this CPU (elsewhere float32 sgemm is faster)."""
    library = _load()
    return library is not None and enabled and bool(library.reprise_packed_many_fast())


def park_helpers() -> None:
    """Have the products' helper threads sleep now instead of waiting on for the next
    product: the caller is about to run threads of its own on the cores."""
    library = _load()
    if library is not None:
        library.reprise_packed_park()


def widened(weight: PackedWeight) -> np.ndarray:
    """The weight in float32 (rows, columns), in this thread's scratch: valid until
    the thread's next call (a layer that keeps only its codes multiplies many rows
    by it through BLAS, then moves on)."""
    codes, scales, biases, rows, groups, group, bits = weight._arguments
    size = rows * groups * group
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < size:
        buffer = _scratch.buffer = np.empty(size, dtype=np.float32)
    out = buffer[:size].reshape(rows, groups * group)
    _load().reprise_packed_widen(codes, scales, biases, rows, groups, group, bits, _address(out))
    return out


def usable(weight: PackedWeight | None) -> bool:
    """A layer has codes only where `faster_here` found the library at its load."""
    return weight is not None and enabled


def available() -> bool:
    return _load() is not None


def faster_here() -> bool:
    """Whether a model loaded now should keep its codes for these products: the
    library's AVX2 and FMA build runs on this CPU (the portable one took a decode
    step 27.7 ms against sgemv's 21.7), or `REPRISE_PACKED_ROWS=on`."""
    library = _load()
    if library is None or not enabled:
        return False
    return _SWITCH == "on" or bool(library.reprise_packed_fast())


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    if not _tried:  # `_tried` is set last: once it is, `_library` is final
        with _loading:  # a second thread must not see it tried and not yet there
            if not _tried:
                _library = _open()
                _tried = True
    return _library


def _open(path: str | None = None) -> ctypes.CDLL | None:
    """The library (the built extension, or the one at `path`) with its functions'
    C types; None where it is missing or was built for other arguments (`ABI`)."""
    if path is None:
        try:
            from app.engine import _kvdecode
        except ImportError:
            return None
        path = _kvdecode.__file__
    library = ctypes.CDLL(path)
    if not hasattr(library, "reprise_packed_abi"):
        return None  # a build from before this file
    library.reprise_packed_abi.argtypes, library.reprise_packed_abi.restype = [], _INT
    if library.reprise_packed_abi() != ABI:
        return None
    library.reprise_packed_fast.argtypes, library.reprise_packed_fast.restype = [], _INT
    library.reprise_packed_gemv.argtypes = [_P, _P, _P, _P, _INT, _INT, _INT, _INT, _P, _INT]
    library.reprise_packed_gemv.restype = _INT
    library.reprise_packed_widen.argtypes = [_P, _P, _P, _INT, _INT, _INT, _INT, _P]
    library.reprise_packed_widen.restype = None
    library.reprise_packed_rows.argtypes = [_P, _P, _P, _P, _INT, _INT, _INT, _INT, _INT, _P, _INT]
    library.reprise_packed_rows.restype = _INT
    library.reprise_packed_many_fast.argtypes, library.reprise_packed_many_fast.restype = [], _INT
    library.reprise_packed_park.argtypes, library.reprise_packed_park.restype = [], None
    return library
