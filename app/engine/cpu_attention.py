"""Attention on the CPU path, its softmax computed with numpy.

Why: on a Linux CPU the engine runs float32 weights through OpenBLAS, so the
matmuls are fast, but mlx's CPU element-wise kernels are not vectorised in
the Linux wheel: `mx.exp` over the 19M scores of one layer's 512-token
prefill step at 4k context took 356 ms where numpy's took 13-23 ms, and the
softmax was most of a long prompt's prefill.

How: the two products stay in mlx (its OpenBLAS, its allocator); the scores
are evaluated and numpy works on them in place, through the buffer mlx
exports without a copy: the causal mask, the shift by the row maximum, the
exp and the row sums. The scores array is fresh (made by the matmul just
before, referenced nowhere else), so writing into it changes nothing any
other array holds. The division by the sums comes after the values product,
on the smaller array. Query rows go in blocks, so that one block's scores
stay small whatever the context length.

`mx.fast.scaled_dot_product_attention` stays the reference (tests compare the
two) and the path everywhere else: on a GPU, for half-precision arrays (whose
arithmetic numpy would widen anyway) and for attention sinks. Each call
evaluates its inputs, cutting the graph at every attention layer; on the CPU
that costs less than it saves (`reprise bench cpu --context`).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

from app.engine import cpu_blas

# The scores of one block of query rows stay under this many bytes.
_BLOCK_BYTES = 32 * 1024 * 1024

# `REPRISE_CPU_ATTENTION=mlx` keeps mlx's own attention (benches compare the two).
enabled = os.environ.get("REPRISE_CPU_ATTENTION", "numpy") != "mlx"


def applies(queries: mx.array, keys, sinks) -> bool:
    """Whether this call is computed here: float32 arrays on the CPU, no sinks."""
    return (
        enabled
        and sinks is None
        and isinstance(keys, mx.array)
        and queries.dtype == mx.float32
        and keys.dtype == mx.float32
        and mx.default_device() == mx.cpu
    )


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask) -> mx.array:
    """What `mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale,
    mask=mask)` gives, for grouped-query heads, `mask` None, "causal" or an array
    (boolean: True attends; otherwise added to the scores)."""
    batch, heads, rows, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    given = _given_mask(mask, kv_heads, group)
    if rows == 1:
        return _one_query(queries, keys, values, scale, given)
    q = (queries * scale).reshape(batch, kv_heads, group, rows, dim)
    causal = isinstance(mask, str) and rows > 1
    step = max(1, _BLOCK_BYTES // (4 * batch * heads * length))
    blocks = []
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        # Under a causal mask the block's last row sees keys up to length - rows + stop.
        visible = length - rows + stop if causal else length
        block_q = q[:, :, :, start:stop].reshape(batch, kv_heads, -1, dim)
        scores = block_q @ keys[..., :visible, :].swapaxes(-1, -2)
        mx.eval(scores)
        shaped = np.asarray(scores).reshape(batch, kv_heads, group, stop - start, visible)
        if causal:
            _hide_future(shaped, length - rows + start)
        elif given is not None:
            _apply(shaped, given[..., start:stop, :])
        totals = exp_in_place(shaped)
        out = (scores @ values[..., :visible, :]) / mx.array(totals.reshape(*scores.shape[:-1], 1))
        blocks.append(out.reshape(batch, kv_heads, group, stop - start, -1))
    out = blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=3)
    return out.reshape(batch, heads, rows, -1)


def _one_query(queries, keys, values, scale: float, given) -> mx.array:
    """A decode step in numpy on views of mlx's buffers, its products through the
    OpenBLAS mlx uses (`cpu_blas`): one evaluation, where mlx's one-row products
    and a second cut of the graph cost more than the attention itself (0.26 ms
    against mlx's fused attention's 1.26 ms a layer at 4k tokens here)."""
    mx.eval(queries, keys, values)
    batch, heads, _, dim = queries.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    q = np.asarray(queries).reshape(batch, kv_heads, group, dim) * np.float32(scale)
    k, v = np.asarray(keys), np.asarray(values)
    scores = np.empty((batch, kv_heads, group, k.shape[2]), np.float32)
    out = np.empty((batch, kv_heads, group, v.shape[3]), np.float32)
    cpu_blas.stacked_matmul(q, k.swapaxes(-1, -2), scores)
    if given is not None:
        _apply(scores, given[..., 0, :])
    totals = exp_in_place(scores)
    cpu_blas.stacked_matmul(scores, v, out)
    out /= totals
    return mx.array(out.reshape(batch, heads, 1, -1))


def _hide_future(scores: np.ndarray, first_position: int) -> None:
    """Causal: row i (at position first_position + i) sees keys up to its position;
    only the last few columns hold any later key."""
    block_rows, visible = scores.shape[-2], scores.shape[-1]
    tail = scores[..., first_position:visible]
    later = np.arange(visible - first_position)[None, :] > np.arange(block_rows)[:, None]
    tail[..., later] = -np.inf


def _apply(scores: np.ndarray, mask: np.ndarray) -> None:
    if mask.dtype == np.bool_:
        np.putmask(scores, ~np.broadcast_to(mask, scores.shape), -np.inf)
    else:
        scores += mask


def exp_in_place(scores: np.ndarray) -> np.ndarray:
    """scores -> exp(scores - row maximum), in place; the row sums."""
    top = scores.max(axis=-1, keepdims=True)
    top[~np.isfinite(top)] = 0  # a row that sees nothing gives zeros, not NaN
    np.subtract(scores, top, out=scores)
    np.exp(scores, out=scores)
    totals = scores.sum(axis=-1, keepdims=True)
    totals[totals == 0] = 1
    return totals


def _given_mask(mask, kv_heads: int, group: int) -> np.ndarray | None:
    """An array mask as numpy, shaped to broadcast over (batch, kv heads, group, rows,
    length): mlx-lm's masks are (rows, length) or (batch, heads or 1, rows, length)."""
    if not isinstance(mask, mx.array):
        return None
    given = np.asarray(mask)
    if given.dtype != np.bool_:
        given = given.astype(np.float32)
    while given.ndim < 4:
        given = given[None]
    batch, heads, rows, length = given.shape
    if heads == 1:
        return given[:, :, None]
    return given.reshape(batch, kv_heads, group, rows, length)
