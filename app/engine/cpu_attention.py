"""Attention on the CPU path, computed with numpy.

Why: on a Linux CPU the engine runs float32 weights through OpenBLAS, so the
matmuls are fast, but mlx's CPU element-wise kernels are not vectorised in
the Linux wheel: `mx.exp` over the 19M scores of one layer's 512-token
prefill step at 4k context took 356 ms where numpy's took 13-23 ms, and the
softmax was most of a long prompt's prefill. numpy reads the same memory
(mlx arrays export their buffers without a copy) and its exp, max and sum are
SIMD code; its matmuls go through its own OpenBLAS.

The maths is the plain one (scores, the causal or given mask, a softmax
shifted by the row maximum, the weighted values), in blocks of query rows
so that the scores of one block stay small whatever the context length.
`mx.fast.scaled_dot_product_attention` stays the reference (tests compare the
two) and the path everywhere else: on a GPU, for half-precision arrays (whose
arithmetic numpy would widen anyway) and for attention sinks.

Each call evaluates its inputs: the graph is cut at every attention layer.
On the CPU that costs less than it saves (measured in `reprise bench cpu`).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np

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
    mx.eval(queries, keys, values, *([mask] if isinstance(mask, mx.array) else []))
    batch, heads, rows, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    q = np.asarray(queries).reshape(batch, kv_heads, group, rows, dim)
    k = np.asarray(keys)[:, :, None]
    v = np.asarray(values)[:, :, None]
    given = _given_mask(mask, kv_heads, group)
    causal = isinstance(mask, str) and rows > 1
    out = np.empty((batch, kv_heads, group, rows, v.shape[-1]), np.float32)
    step = max(1, _BLOCK_BYTES // (4 * batch * heads * length))
    for start in range(0, rows, step):
        stop = min(rows, start + step)
        # Under a causal mask the block's last row sees keys up to length - rows + stop.
        visible = length - rows + stop if causal else length
        scores = np.matmul(q[:, :, :, start:stop] * np.float32(scale), _keys_t(k, visible))
        if causal:
            _hide_future(scores, length - rows + start)
        elif given is not None:
            _apply(scores, given[..., start:stop, :])
        out[:, :, :, start:stop] = _softmax_times(scores, v[..., :visible, :])
    return mx.array(out.reshape(batch, heads, rows, -1))


def _keys_t(k: np.ndarray, visible: int) -> np.ndarray:
    return k[..., :visible, :].swapaxes(-1, -2)


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


def _softmax_times(scores: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(scores) @ v, shifting by the row maximum; the division comes after the
    product, on the smaller array."""
    top = scores.max(axis=-1, keepdims=True)
    top[~np.isfinite(top)] = 0  # a row that sees nothing gives zeros, not NaN
    np.subtract(scores, top, out=scores)
    np.exp(scores, out=scores)
    total = scores.sum(axis=-1, keepdims=True)
    total[total == 0] = 1
    out = np.matmul(scores, v)
    out /= total
    return out


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
