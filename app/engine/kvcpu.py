"""Decode attention over the app's packed KV cache on the CPU (issue 13).

The products go to compiled code (kvnative, kvdecode.c) where it was built:
each row is widened in L1 and multiplied at once, so the packed bytes are all
that is read (8-bit at 2k tokens: 0.27 ms a layer, against 0.53 in the numpy
below). The numpy code is the fallback (no C compiler at install time,
`REPRISE_KV_NATIVE=off`) and the reference the tests hold the C to.

Why numpy: a decode step's attention is a few small products over one layer's
tokens, and on the CPU mlx charges for every graph node and every `mx.eval`
(several µs each) while its element-wise kernels are scalar code in the Linux
wheel. So one eval brings in the query and the new token's rows, and the rest
runs on numpy views of the packed buffers (`np.asarray` of an evaluated mlx
array, sliced or not, shares its memory), with one small array back to mlx.

The maths: per quantization group of a row, x·(s c + b) = s (x·c) + b Σx for
the scores, and Σ_t w_t (s_t c_t + b_t) = (w s)ᵀ c + w·b for the values. The
only full-size pass is the codes to float32, `_BLOCK_BYTES` at a time into a
reused scratch that stays in the CPU's cache: no float copy of the bulk is ever
whole. A 4-bit byte holds dimension 2j in its low nibble and 2j+1 in its high
one; a group's low nibbles are widened into the first half of its columns and
the high ones into the second, and the query's dimensions are ordered to match
(the values' output is put back in order at the end). Rotated keys: the query
is rotated for the bulk. The 16-bit rows (sink and tail) are widened with bit
arithmetic, as numpy's float16 cast is scalar code (about 3x slower here).
"""

from __future__ import annotations

import math
import threading
from functools import cache

import mlx.core as mx
import numpy as np

from app.engine import cpu_attention, cpu_blas, kvnative
from app.engine.tokenstore import rotation_matrix

# Bulk rows of one KV head widened at a time: 512 KiB of float32 (2k tokens of 64
# dims), half of a core's L2 cache here.
_BLOCK_BYTES = 512 << 10
_scratch = threading.local()


def decode(layout, queries: mx.array, scale: float) -> mx.array:
    """Attention of one query per head over `layout` (a kvattention.PackedLayout)."""
    batch, heads, _, dim = queries.shape
    start, end = layout.bulk_start, layout.bulk_end
    # Whole buffers, sliced in numpy: evaluating eight mlx slices cost 80 µs a layer.
    mx.eval(queries, [store.buffers for store in (*layout.exact, *layout.bulk)])
    exact_k, exact_v = (_rows(store) for store in layout.exact)
    bulk_k, bulk_v = (_rows(store, start, end) for store in layout.bulk)
    kv_heads = exact_k[0].shape[0] // batch
    q = np.asarray(queries).reshape(batch * kv_heads, heads // kv_heads, dim) * np.float32(scale)

    bulk_q = cpu_blas.stacked_matmul(q, hadamard(dim)) if layout.rotated else q
    if kvnative.available():
        held = (*layout.exact, *layout.bulk)
        parts = (exact_k, exact_v, bulk_k, bulk_v)
        stores = [kvnative.Rows(s.bits, p) for s, p in zip(held, parts, strict=True)]
        if all(rows.fits(q.shape[1]) for rows in stores):
            return mx.array(_native(stores, q, bulk_q).reshape(batch, heads, 1, -1))
    rows = exact_k[0].shape[1]
    scores = np.empty((*q.shape[:2], rows + end - start), np.float32)
    cpu_blas.stacked_matmul(q, _widen_half(exact_k[0]).transpose(0, 2, 1), scores[..., :rows])
    _bulk_scores(layout.bulk[0], bulk_k, bulk_q, scores[..., rows:])
    totals = cpu_attention.exp_in_place(scores)
    out = cpu_blas.stacked_matmul(scores[..., :rows], _widen_half(exact_v[0]))
    out += _bulk_values(layout.bulk[1], bulk_v, scores[..., rows:])
    out /= totals
    return mx.array(out.reshape(batch, heads, 1, -1))


def _native(stores: list, q: np.ndarray, bulk_q: np.ndarray) -> np.ndarray:
    """`decode` by the compiled code (kvnative.attend): scores of the exact rows and of
    the bulk, one softmax, both value sums, every KV head in one call, the tokens
    shared among the turn's threads (the products' helpers: `cpu_blas.threads`)."""
    out = np.empty((*q.shape[:2], stores[1].dim), np.float32)
    q, bulk_q = np.ascontiguousarray(q), np.ascontiguousarray(bulk_q)
    kvnative.attend(stores, q, bulk_q, out, cpu_blas.threads() or 1)
    return out


def widened(store, start: int, end: int) -> mx.array | None:
    """A float16 store's tokens [start, end) as float32, (batch, KV heads, tokens,
    width), widened by the compiled code: for the products of many query rows, where
    mlx's cast (scalar code here) cost more than the rest of a short turn's attention.
    None where that code is not there."""
    if store.bits is not None or store.dtype != mx.float16 or not kvnative.available():
        return None  # (bfloat16 rows, from a file: numpy has no such type)
    mx.eval(store.buffers)
    rows = np.asarray(store.buffers[0])[:, :, store.span(start, end)]
    if rows.strides[2] != rows.strides[3] * rows.shape[3]:
        # A buffer whose first update covered it whole keeps that update's layout in
        # mlx (a model's values are a transposed view): its tokens are not one run.
        rows = np.ascontiguousarray(rows)
    # Into this thread's scratch, which mlx then copies into memory its allocator
    # reuses: a fresh array each call was pages the OS mapped anew every time.
    return mx.array(kvnative.widen_halves(rows, _scratch_for(rows.shape)))


def _rows(store, start: int = 0, end: int | None = None) -> list[np.ndarray]:
    """A store's tokens [start, end) as numpy views of its evaluated buffers, (batch x
    KV heads, tokens, width): only the token axis is sliced, so the merge is a view."""
    span = store.span(start, end)
    views = (np.asarray(buffer)[:, :, span] for buffer in store.buffers)
    return [view.reshape(view.shape[0] * view.shape[1], *view.shape[2:]) for view in views]


def _widen_half(h: np.ndarray) -> np.ndarray:
    """float16 -> float32 by its bits: shifted 13 places up, a float16's exponent and
    mantissa are a float32's of the value times 2^-112 (subnormals included); the
    shift of the sign-extended bits leaves the sign in place and three copies of it
    below, which the mask clears. Infinities and NaN come out finite: a KV row never
    holds them (its oracle would be NaN anyway)."""
    bits = np.left_shift(h.view(np.int16), 13, dtype=np.int32)
    bits &= np.int32(~0x70000000)
    wide = bits.view(np.float32)
    wide *= np.float32(2.0**112)
    return wide


@cache
def hadamard(dim: int) -> np.ndarray:
    """The keys' rotation as a matrix on row vectors: q @ it is `tokenstore.rotate(q)`."""
    return np.array(rotation_matrix(dim))


def _scratch_for(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of `shape`, reused by this thread's calls."""
    size = math.prod(shape)
    held = getattr(_scratch, "floats", None)
    if held is None or held.size < size:
        held = _scratch.floats = np.empty(size, np.float32)
    return held[:size].reshape(shape)


def _lane_order(x: np.ndarray, groups: int) -> np.ndarray:
    """(..., dim) in the 4-bit scratch's order: per group, even dimensions then odd."""
    *lead, dim = x.shape
    split = x.reshape(*lead, groups, dim // groups // 2, 2)
    return split.swapaxes(-1, -2).reshape(*lead, dim)


def _in_order(x: np.ndarray, groups: int) -> np.ndarray:
    """The inverse of `_lane_order`."""
    *lead, dim = x.shape
    split = x.reshape(*lead, groups, 2, dim // groups // 2)
    return split.swapaxes(-1, -2).reshape(*lead, dim)


def _widened(store, codes: np.ndarray, groups: int):
    """Per KV head and block of tokens: (head, first, last token, the rows as float32,
    (tokens, groups, group size)): the codes of a quantized store (4-bit in lane
    order), the values of a 16-bit one. A block is at most `_BLOCK_BYTES` (it stays in
    the CPU's cache for the products that read it) and reuses one scratch."""
    rows, tokens, width = codes.shape
    dim = width * codes.itemsize * 8 // (store.bits or 16)
    step = max(1, _BLOCK_BYTES // (4 * dim))
    for r in range(rows):
        for a in range(0, tokens, step):
            b = min(tokens, a + step)
            yield r, a, b, _widen(store, codes[r, a:b], groups).reshape(b - a, groups, -1)


def _widen(store, codes: np.ndarray, groups: int) -> np.ndarray:
    """(tokens, width) codes as float32 (tokens, dim)."""
    if store.bits is None:
        return _widen_half(codes)
    codes = codes.view(np.uint8)
    if store.bits == 8:
        wide = _scratch_for(codes.shape)
        np.copyto(wide, codes, casting="unsafe")
        return wide
    tokens, width = codes.shape
    wide = _scratch_for((tokens, groups, 2, width // groups))
    by_group = codes.reshape(tokens, groups, -1)
    np.copyto(wide[..., 0, :], by_group & 15, casting="unsafe")
    np.copyto(wide[..., 1, :], by_group >> 4, casting="unsafe")
    return wide.reshape(tokens, 2 * width)


def _scales(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A quantized store's scales and biases as float32, (rows, groups, tokens)."""
    return tuple(_widen_half(x).transpose(0, 2, 1) for x in parts[1:])


def _bulk_scores(store, parts: list[np.ndarray], q: np.ndarray, out: np.ndarray) -> None:
    """out = q @ bulkᵀ: q (rows, query group, dim), out (rows, query group, tokens)."""
    groups = 1 if store.bits is None else parts[1].shape[-1]
    if store.bits == 4:
        q = _lane_order(q, groups)
    by_group = q.reshape(*q.shape[:2], groups, -1)
    # q·codes per group: (rows, groups, query group, tokens)
    dots = (
        out[:, None]
        if groups == 1
        else np.empty((out.shape[0], groups, *out.shape[1:]), np.float32)
    )
    for r, a, b, wide in _widened(store, parts[0], groups):
        for g in range(groups):
            cpu_blas.matmul(by_group[r, :, g], wide[:, g].T, dots[r, g, :, a:b])
    if store.bits is None:
        return
    scales, biases = _scales(parts)
    sums = by_group.sum(-1)  # (rows, query group, groups)
    for g in range(groups):
        if g == 0:
            np.multiply(dots[:, 0], scales[:, None, 0], out=out)
        else:
            out += dots[:, g] * scales[:, None, g]
        out += sums[..., g, None] * biases[:, None, g]


def _bulk_values(store, parts: list[np.ndarray], w: np.ndarray) -> np.ndarray:
    """w @ bulk: w (rows, query group, tokens) -> (rows, query group, dim)."""
    if store.bits is None:
        out = np.zeros((*w.shape[:2], parts[0].shape[-1]), np.float32)
        for r, a, b, wide in _widened(store, parts[0], 1):
            out[r] += cpu_blas.matmul(w[r, :, a:b], wide[:, 0])
        return out
    scales, biases = _scales(parts)
    groups = scales.shape[1]
    size = parts[0].shape[-1] * 32 // store.bits // groups
    # The w·b terms, one per group, over its dimensions; then (w s) @ codes.
    out = np.repeat(cpu_blas.stacked_matmul(w, biases.transpose(0, 2, 1))[..., None], size, axis=-1)
    weighted = w[:, :, None] * scales[:, None]  # (rows, query group, groups, tokens)
    for r, a, b, wide in _widened(store, parts[0], groups):
        for g in range(groups):
            out[r, :, g] += cpu_blas.matmul(weighted[r, :, g, a:b], wide[:, g])
    out = out.reshape(*w.shape[:2], -1)
    return _in_order(out, groups) if store.bits == 4 else out
