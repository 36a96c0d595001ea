"""A decode step's products on the CPU path, through the OpenBLAS mlx uses.

Why: a decode step multiplies one row by every weight matrix once. mlx's CPU
matmul hands every shape to `cblas_sgemm`, and the OpenBLAS most Linux systems
ship (0.3.21 in Debian 12) packs the whole weight matrix before a one-row
product: a 576x1536 float32 layer took 0.23 ms through sgemm against 0.045 ms
through `cblas_sgemv` on the same library, and the tied 49,152-row output
layer of SmolLM2 4.4 ms against 2.1 ms. A decode step is those products and
little else, so it read its 540 MB of weights at a third of the speed the
memory allows.

How: on the float32 CPU path (`loading`), the dense layers become `RowLinear`
and the embedding `RowEmbedding`. A call with more than one row (prefill)
goes to mlx as before. A one-row call evaluates its input, lets sgemv read
the weight in place (numpy's view of mlx's buffer, no copy) and returns the
result as a new mlx array. That cuts the graph at each layer; on the CPU the
cut costs less than the product saves (`reprise bench cpu` runs both).

The products go to the library mlx resolved `cblas_sgemm` to, called through
ctypes, never to numpy's matmul: numpy brings its own OpenBLAS, and two
OpenBLAS thread pools on two cores spin against each other (a 4k-token decode
step with numpy's matmul in the attention took 140-550 ms instead of 50).

`REPRISE_CPU_GEMV=off` keeps mlx's own matmul for the dense layers (benches
compare the two).
"""

from __future__ import annotations

import ctypes
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map_with_path

from app.engine import blas, packed_rows

enabled = os.environ.get("REPRISE_CPU_GEMV", "on") != "off"

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enum values
# Fewer rows than this and a matrix of at least GEMV_ELEMENTS: one matrix-vector
# product per row (sgemm packs the other matrix first). A decode step's scores, 3
# queries a KV head: 3 sgemv 347 against sgemm 402 µs at 4k tokens, but sgemm 121
# against 204 µs at 512 tokens, where the calls' own cost dominates.
GEMM_ROWS = 4
GEMV_ELEMENTS = 2**17
# Products up to this many multiply-adds go to numpy's matmul: OpenBLAS runs them on
# the calling thread (its threshold for threads is 4 x 65,536), so no pool wakes,
# and numpy's call costs a few µs where the ctypes route costs 15-20.
SINGLE_THREADED = 4 * 65536
_library: ctypes.CDLL | None = None
_INT, _FLOAT, _POINTER = ctypes.c_int, ctypes.c_float, ctypes.c_void_p


def _openblas() -> ctypes.CDLL:
    """The library mlx's matmul resolved to (blas.preload), with the two routines typed."""
    global _library
    if _library is None:
        library = ctypes.CDLL(blas.CHOICE.path)
        library.cblas_sgemv.restype = library.cblas_sgemm.restype = None
        library.cblas_sgemv.argtypes = [_INT] * 4 + [_FLOAT, _POINTER, _INT, _POINTER, _INT]
        library.cblas_sgemv.argtypes += [_FLOAT, _POINTER, _INT]
        library.cblas_sgemm.argtypes = [_INT] * 6 + [_FLOAT, _POINTER, _INT, _POINTER, _INT]
        library.cblas_sgemm.argtypes += [_FLOAT, _POINTER, _INT]
        _library = library
    return _library


def set_threads(count: int) -> bool:
    """Resize OpenBLAS's thread pool (never while a BLAS call runs); False without it."""
    if blas.CHOICE.name != "openblas":
        return False
    _openblas().openblas_set_num_threads(count)
    return True


def threads() -> int | None:
    """OpenBLAS's thread count now (None without OpenBLAS)."""
    return _openblas().openblas_get_num_threads() if blas.CHOICE.name == "openblas" else None


def available() -> bool:
    """Whether products go through OpenBLAS here: it is loaded and mlx runs on the CPU."""
    return blas.CHOICE.name == "openblas" and mx.default_device() == mx.cpu


def _leading(m: np.ndarray) -> int | None:
    """The row stride of a float32 matrix in elements, None when BLAS cannot read it
    in place (its rows not contiguous, or overlapping as in a broadcast view)."""
    if m.dtype != np.float32 or m.ndim != 2:
        return None
    rows, columns = m.shape
    if columns > 1 and m.strides[1] != 4:
        return None
    if rows == 1:
        return max(1, columns)
    stride, rest = divmod(m.strides[0], 4)
    return stride if rest == 0 and stride >= max(1, columns) else None


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`a @ b` for float32 matrices, as `np.matmul(a, b, out=out)`. Slices of larger
    buffers and transposed views are read in place."""
    if out is None:
        out = np.empty((a.shape[0], b.shape[1]), np.float32)
    if not available() or a.shape[0] * a.shape[1] * b.shape[1] <= SINGLE_THREADED:
        return _numpy_matmul(a, b, out)
    if out.size == 0 or a.shape[1] == 0:  # no tokens yet: nothing BLAS could be handed
        out[...] = 0
        return out
    lda = _leading(a)
    if lda is None:
        a = np.ascontiguousarray(a, np.float32)
        lda = _leading(a)
    ldb, transposed = _leading(b), False
    if ldb is None:
        ldb, transposed = _leading(b.T), True  # a transposed view: read as stored
        b = b.T
    if ldb is None:
        b, transposed = np.ascontiguousarray(b.T, np.float32), False
        ldb = _leading(b)
    ldc = _leading(out)
    target = out if ldc is not None else np.empty(out.shape, np.float32)
    _product((a, lda), (b, ldb), transposed, (target, ldc or target.shape[1]))
    if target is not out:
        out[...] = target
    return out


def stacked_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`np.matmul` over stacks of matrices: `a` (..., n, k), `b` (..., k, m) with the
    same leading shape, or one matrix (k, m) for all."""
    if out is None:
        out = np.empty((*a.shape[:-1], b.shape[-1]), np.float32)
    for i in np.ndindex(*a.shape[:-2]):
        matmul(a[i], b if b.ndim == 2 else b[i], out[i])
    return out


def _product(a: tuple, b: tuple, b_transposed: bool, out: tuple) -> None:
    """out = a @ b (b stored transposed when `b_transposed`); each (matrix, row stride)."""
    (a, lda), (b, ldb), (out, ldc) = a, b, out
    rows, inner = a.shape
    columns = out.shape[1]
    if rows < GEMM_ROWS and b.size >= GEMV_ELEMENTS:
        at, into = a.ctypes.data, out.ctypes.data
        for r in range(rows):
            _openblas().cblas_sgemv(
                _ROW_MAJOR, _NO_TRANS if b_transposed else _TRANS, *b.shape, 1.0,
                b.ctypes.data, ldb, at + 4 * r * lda, 1, 0.0, into + 4 * r * ldc, 1,
            )  # fmt: skip
        return
    _openblas().cblas_sgemm(
        _ROW_MAJOR, _NO_TRANS, _TRANS if b_transposed else _NO_TRANS, rows, columns, inner,
        1.0, a.ctypes.data, lda, b.ctypes.data, ldb, 0.0, out.ctypes.data, ldc,
    )  # fmt: skip


def _numpy_matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> np.ndarray:
    if a.shape[0] >= GEMM_ROWS:
        return np.matmul(a, b, out=out)
    for r in range(a.shape[0]):  # numpy's OpenBLAS too is slower with so few rows
        np.matmul(a[r], b, out=out[r])
    return out


def _one_row(x: mx.array, weight: mx.array) -> bool:
    return (
        enabled
        and x.size == x.shape[-1]
        and x.dtype == mx.float32
        and weight.dtype == mx.float32
        and weight.ndim == 2
    )


def gemv(weight: np.ndarray, row: np.ndarray) -> np.ndarray:
    """`weight @ row` for a C-contiguous float32 matrix and a float32 vector."""
    outputs, inputs = weight.shape
    row = np.ascontiguousarray(row, np.float32)
    out = np.empty(outputs, dtype=np.float32)
    _openblas().cblas_sgemv(
        _ROW_MAJOR, _NO_TRANS, outputs, inputs, 1.0,
        weight.ctypes.data, inputs, row.ctypes.data, 1, 0.0, out.ctypes.data, 1,
    )  # fmt: skip
    return out


def row_product(
    weight: np.ndarray | None, row: np.ndarray, packed: packed_rows.PackedWeight | None = None
) -> np.ndarray:
    """`weight @ row`: through the weight as stored where the layer was quantized
    (`packed_rows`, on this turn's threads), else sgemv on the float32 weight (None:
    the layer keeps only its codes)."""
    if packed is not None and (weight is None or packed_rows.usable(packed)):
        return packed_rows.product(packed, row, threads() or 1)
    return gemv(weight, row)


def row_times_transposed(
    x: mx.array, weight: mx.array, packed: packed_rows.PackedWeight | None = None
) -> mx.array:
    """`x @ weight.T` for a single row `x` (any leading shape of size 1)."""
    mx.eval(x, weight)
    w = np.asarray(weight)  # mlx's own buffer, no copy
    if not w.flags.c_contiguous:
        return x @ weight.T
    out = row_product(w, np.asarray(x).reshape(w.shape[1]), packed)
    return mx.array(out).reshape(*x.shape[:-1], w.shape[0])


class CodesLinear(nn.QuantizedLinear):
    """A quantized linear layer of the codes path (its scales in float32), whose
    one-row calls read its codes (mlx's quantized matmul is scalar code on a Linux
    CPU). More rows stay mlx's, lazy: a prefill's logits are never evaluated."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _one_row(x, self.scales):
            return super().__call__(x)
        y = _codes_times_transposed(x, self.packed_weight)
        return y + self["bias"] if "bias" in self else y


class CodesEmbedding(nn.QuantizedEmbedding):
    """A quantized embedding of the codes path, whose tied output layer reads its
    codes for one row."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _one_row(x, self.scales):
            return super().as_linear(x)
        return _codes_times_transposed(x, self.packed_weight)


def _codes_times_transposed(x: mx.array, packed: packed_rows.PackedWeight) -> mx.array:
    mx.eval(x)
    out = row_product(None, np.asarray(x).reshape(packed.shape[1]), packed)
    return mx.array(out).reshape(*x.shape[:-1], packed.shape[0])


class RowLinear(nn.Linear):
    """`nn.Linear` whose one-row calls go through sgemv."""

    def __call__(self, x: mx.array) -> mx.array:
        weight = self["weight"]
        if not _one_row(x, weight):
            return super().__call__(x)
        y = row_times_transposed(x, weight, getattr(self, "packed_weight", None))
        return y + self["bias"] if "bias" in self else y


class RowEmbedding(nn.Embedding):
    """`nn.Embedding` whose tied output layer (`as_linear`) goes through sgemv for one row."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _one_row(x, self.weight):
            return super().as_linear(x)
        return row_times_transposed(x, self.weight, getattr(self, "packed_weight", None))


_CODES = {nn.QuantizedLinear: CodesLinear, nn.QuantizedEmbedding: CodesEmbedding}


def _row_layer(_path: str, module: nn.Module) -> nn.Module:
    # Exact classes only: a subclass may compute something else in its __call__.
    if type(module) in _CODES and module.scales.dtype == mx.float32 and packed_rows.available():
        packed = packed_rows.of_module(module)
        if packed is not None:  # the codes path kept it: its class changes, nothing else
            module.__class__ = _CODES[type(module)]
            module.packed_weight = packed
        return module
    if type(module) is nn.Linear:
        layer = RowLinear(1, 1, bias=False)
    elif type(module) is nn.Embedding:
        layer = RowEmbedding(1, 1)
    else:
        return module
    layer.weight = module.weight
    if "bias" in module:
        layer.bias = module.bias
    layer.packed_weight = getattr(module, "packed_weight", None)
    return layer


def install(model: nn.Module) -> None:
    """Route the one-row products of `model`'s dense layers through sgemv."""
    leaves = tree_map_with_path(_row_layer, model.leaf_modules(), is_leaf=nn.Module.is_module)
    model.update_modules(leaves)
