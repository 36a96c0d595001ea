"""Decode attention over the app's packed KV cache on the CPU, in numpy (issue 13).

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

from app.engine import cpu_attention

# Bulk rows widened at a time: 4 MiB of float32 (5k tokens of 3 KV heads x 64 dims).
# Smaller blocks were not faster (the products stream anyway) and cost a pass of
# numpy calls each.
_BLOCK_BYTES = 4 << 20
_scratch = threading.local()
_GEMM_ROWS = 4  # queries per KV head from which one matrix product is used


def decode(layout, queries: mx.array, scale: float) -> mx.array:
    """Attention of one query per head over `layout` (a kvattention.PackedLayout)."""
    batch, heads, _, dim = queries.shape
    start, end = layout.bulk_start, layout.bulk_end
    parts = [[layout.exact_rows(p), *layout.bulk_parts(p)] for p in (0, 1)]
    mx.eval(queries, parts)
    exact_k, *bulk_k = (_rows(x) for x in parts[0])
    exact_v, *bulk_v = (_rows(x) for x in parts[1])
    kv_heads = parts[0][0].shape[1]
    q = np.asarray(queries).reshape(batch * kv_heads, heads // kv_heads, dim) * np.float32(scale)

    rows = exact_k.shape[1]
    scores = np.empty((*q.shape[:2], rows + end - start), np.float32)
    _product(q, _widen_half(exact_k).transpose(0, 2, 1), out=scores[..., :rows])
    bulk_q = q @ _hadamard(dim) if layout.rotated else q
    _bulk_scores(layout.bulk[0], bulk_k, bulk_q, scores[..., rows:])
    totals = cpu_attention.exp_in_place(scores)
    out = _product(scores[..., :rows], _widen_half(exact_v))
    out += _bulk_values(layout.bulk[1], bulk_v, scores[..., rows:])
    out /= totals
    return mx.array(out.reshape(batch, heads, 1, -1))


def _rows(x: mx.array) -> np.ndarray:
    """An evaluated (batch, kv heads, tokens, width) slice as a numpy view, the batch
    and head axes merged (a view too: only the token axis is sliced)."""
    a = np.asarray(x)
    return a.reshape(-1, *a.shape[2:])


def _widen_half(h: np.ndarray) -> np.ndarray:
    """float16 -> float32 by its bits: the magnitude shifted into float32's place is
    the value times 2^-112 (subnormals included); then the sign. Infinities and NaN
    come out finite: a KV row never holds them (its oracle would be NaN anyway)."""
    bits = h.view(np.int16).astype(np.int32)  # sign-extended: bit 31 is the sign
    out = (bits & 0x7FFF) << 13
    wide = out.view(np.float32)
    wide *= np.float32(2.0**112)
    out |= bits & np.int32(-(2**31))
    return wide


@cache
def _hadamard(dim: int) -> np.ndarray:
    """The normalized Walsh-Hadamard matrix mlx's transform uses (symmetric), so that
    q @ it is `mx.hadamard_transform(q, scale=1/sqrt(dim))`."""
    eye = mx.eye(dim, dtype=mx.float32)
    return np.array(mx.hadamard_transform(eye, scale=1 / math.sqrt(dim)))


def _scratch_for(shape: tuple[int, ...]) -> np.ndarray:
    """A float32 array of `shape`, reused by this thread's calls."""
    size = math.prod(shape)
    held = getattr(_scratch, "floats", None)
    if held is None or held.size < size:
        held = _scratch.floats = np.empty(size, np.float32)
    return held[:size].reshape(shape)


def _product(x: np.ndarray, m: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x @ m for (rows, query group, k) and (rows, k, n). With fewer than 4 queries a
    KV head, one matrix-vector product per query: OpenBLAS's matrix product with so
    few rows took 1.7x as long here (3 queries: 90 against 54 µs at 2k tokens); from
    4 on it is as fast or faster."""
    if x.shape[1] >= _GEMM_ROWS:
        return np.matmul(x, m, out=out)
    if out is None:
        out = np.empty((*x.shape[:2], m.shape[-1]), np.float32)
    for r in range(x.shape[0]):
        for j in range(x.shape[1]):
            np.matmul(x[r, j], m[r], out=out[r, j])
    return out


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


def _widen(store, codes: np.ndarray, groups: int) -> np.ndarray:
    """A block of rows as float32, (rows, tokens, dim): the codes for a quantized
    store (4-bit in lane order), the values for a 16-bit one."""
    if store.bits is None:
        return _widen_half(codes)
    codes = codes.view(np.uint8)
    if store.bits == 8:
        wide = _scratch_for(codes.shape)
        np.copyto(wide, codes, casting="unsafe")
        return wide
    rows, tokens, width = codes.shape
    wide = _scratch_for((rows, tokens, groups, 2, width // groups))
    by_group = codes.reshape(rows, tokens, groups, -1)
    np.copyto(wide[..., 0, :], by_group & 15, casting="unsafe")
    np.copyto(wide[..., 1, :], by_group >> 4, casting="unsafe")
    return wide.reshape(rows, tokens, 2 * width)


def _blocks(store, parts: list[np.ndarray]):
    """Token ranges of at most `_BLOCK_BYTES` of widened rows."""
    rows, tokens, width = parts[0].shape
    dim = width * parts[0].itemsize * 8 // (store.bits or 16)
    step = max(1, _BLOCK_BYTES // (4 * rows * dim))
    return ((t, min(tokens, t + step)) for t in range(0, tokens, step))


def _scales(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A quantized store's scales and biases as float32, (rows, groups, tokens)."""
    return tuple(_widen_half(x).transpose(0, 2, 1) for x in parts[1:])


def _bulk_scores(store, parts: list[np.ndarray], q: np.ndarray, out: np.ndarray) -> None:
    """out = q @ bulkᵀ: q (rows, query group, dim), out (rows, query group, tokens)."""
    if store.bits is None:
        for a, b in _blocks(store, parts):
            _product(q, _widen(store, parts[0][:, a:b], 1).transpose(0, 2, 1), out[..., a:b])
        return
    scales, biases = _scales(parts)
    groups = scales.shape[1]
    if store.bits == 4:
        q = _lane_order(q, groups)
    by_group = q.reshape(*q.shape[:2], groups, -1)
    sums = by_group.sum(-1)[..., None]  # (rows, query group, groups, 1)
    for a, b in _blocks(store, parts):
        codes = _widen(store, parts[0][:, a:b], groups).reshape(*out.shape[:1], b - a, groups, -1)
        block = out[..., a:b]
        for g in range(groups):
            dots = _product(
                by_group[..., g, :], codes[..., g, :].transpose(0, 2, 1), block if g == 0 else None
            )
            dots *= scales[:, None, g, a:b]
            dots += sums[..., g, :] * biases[:, None, g, a:b]
            if g:
                block += dots


def _bulk_values(store, parts: list[np.ndarray], w: np.ndarray) -> np.ndarray:
    """w @ bulk: w (rows, query group, tokens) -> (rows, query group, dim)."""
    if store.bits is None:
        blocks = _blocks(store, parts)
        return sum(_product(w[..., a:b], _widen(store, parts[0][:, a:b], 1)) for a, b in blocks)
    scales, biases = _scales(parts)
    groups = scales.shape[1]
    size = parts[0].shape[-1] * 32 // store.bits // groups
    # The w·b terms, one per group, over its dimensions; then (w s) @ codes.
    out = np.repeat((w @ biases.transpose(0, 2, 1))[..., None], size, axis=-1)
    weighted = w[:, :, None] * scales[:, None]  # (rows, query group, groups, tokens)
    for a, b in _blocks(store, parts):
        codes = _widen(store, parts[0][:, a:b], groups).reshape(*w.shape[:1], b - a, groups, -1)
        for g in range(groups):
            out[..., g, :] += _product(weighted[..., g, a:b], codes[..., g, :])
    out = out.reshape(*w.shape[:2], -1)
    return _in_order(out, groups) if store.bits == 4 else out
