"""Attention that reads the app's packed KV cache directly (issue 13).

How it reaches the cache. mlx-lm's model code does

    keys, values = cache.update_and_fetch(keys, values)
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, ...)

with `scaled_dot_product_attention` imported from `mlx_lm.models.base` into
each model's module. `install()` puts a wrapper in its place (in `base` and in
every model module already imported that holds the original), which
recognises a `PackedRead` and calls the cache's own attention; every other
call goes to the original untouched, so `KVCache`/`RotatingKVCache` layers and
mlx-lm's `QuantizedKVCache` are not affected.

A `MixedKVCache` only hands out `PackedRead`s once it has seen that its
model's attention goes through the wrapper: its first `update_and_fetch`
returns real dequantized arrays (the reference read) and remembers them; when
the wrapper receives exactly those arrays, it marks the layer and attends from
the packed cache. Model code that calls `mx.fast.scaled_dot_product_attention`
itself, or changes the arrays first, never gets a `PackedRead` and keeps
working on the reference read. Returning a marker rather than lazily built
dequantized arrays matters on the GPU: every graph node costs CPU time in a
decode step, even one that is never evaluated.

The maths, with positions [0, S) the 16-bit sink, [S, q) the quantized bulk
and [q, n) the 16-bit tail (sink and tail are one 16-bit buffer, "exact"):

- decode (one query, no mask): scores for the bulk from the packed keys, for
  the exact rows from their 16-bit buffer, one softmax over both, and the
  values the same way; no full-size dequantized temporary. Rotated keys: the
  query is rotated for the bulk instead of un-rotating the cache. On CUDA this
  is one kernel of ours plus a merge (app/engine/kvkernels.py: mlx's
  `quantized_matmul` there is wrong when the group size equals the head size
  and slow for the values product); on the CPU, numpy on views of the packed
  buffers, products with the codes as floats and the scales and biases applied
  to their results (`cpu_decode`, app/engine/kvcpu.py: mlx's CPU quantized
  matmul is scalar code, widening the bulk first cost 4x the 16-bit attention,
  and the same products as an mlx graph 2.5x); elsewhere `mx.quantized_matmul`
  (Metal: not measured here, no Mac).
- a short turn over float16 rows on the CPU (a follow-up message, the CPU
  path's 16 bits): compiled products that read the rows where they are
  (app/engine/turn_attention.py).
- prefill and masked calls: the bulk dequantized once for all queries (a
  temporary of one layer), the exact rows put in place by a concatenation,
  then `mx.fast.scaled_dot_product_attention`.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models import base

from app.engine import cpu_attention, kvcpu, kvkernels, turn_attention

_FAST_WIDEN = (8, 4)  # widths the CPU unpacks with byte views


@dataclass(frozen=True)
class PackedLayout:
    """What attention reads from one layer: `bulk` and `exact` are its TokenStores
    (keys, values); bulk positions [bulk_start, bulk_end) are attended quantized,
    every exact row (the sink rows first, then the tail) in 16 bits."""

    bulk: list
    bulk_start: int
    bulk_end: int
    exact: list
    sink_rows: int
    count: int

    @property
    def rotated(self) -> bool:
        return self.bulk[0].rotate

    def bulk_parts(self, part: int) -> list[mx.array]:
        return self.bulk[part].encoded(self.bulk_start, self.bulk_end)

    def exact_rows(self, part: int) -> mx.array:
        return self.exact[part].encoded()[0]


class PackedRead:
    """What a MixedKVCache's `update_and_fetch` returns once packed reads are on:
    not an array; the patched attention reads the cache it names."""

    def __init__(self, cache, part: int, dtype: mx.Dtype) -> None:
        self.cache, self.part, self.dtype = cache, part, dtype

    @property
    def shape(self) -> tuple[int, ...]:
        buffer = self.cache.exact[self.part].buffers[0]
        return (buffer.shape[0], buffer.shape[1], self.cache.count, buffer.shape[3])

    @property
    def ndim(self) -> int:
        return 4


_original = base.scaled_dot_product_attention
_seen_modules = 0


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
    """mlx-lm's function, routing the app's packed caches to their own attention."""
    if isinstance(keys, PackedRead):
        return keys.cache.attend(queries, scale, mask, sinks)
    handshake = getattr(cache, "handshake", None)
    if handshake is not None and handshake[0] is keys and handshake[1] is values:
        cache.packed_reads = True
        return cache.attend(queries, scale, mask, sinks)
    if cpu_attention.applies(queries, keys, sinks):
        return cpu_attention.attention(queries, keys, values, scale, mask)
    return _original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install() -> None:
    """Put the wrapper into mlx-lm's `base` and every imported module that holds
    the original (cheap when no module was imported since the last call)."""
    global _seen_modules
    if len(sys.modules) == _seen_modules:
        return
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm.")
            and getattr(module, "scaled_dot_product_attention", None) is _original
        ):
            module.scaled_dot_product_attention = scaled_dot_product_attention
    _seen_modules = len(sys.modules)


def attend(layout: PackedLayout, queries: mx.array, scale: float, mask, sinks) -> mx.array:
    decode = queries.shape[2] == 1 and mask is None and sinks is None
    if decode and layout.bulk_end > layout.bulk_start:
        if kvkernels.supports(layout, queries):
            return kvkernels.decode(layout, queries, scale)
        if _on_the_cpu_path(layout, queries):
            return cpu_decode(layout, queries, scale)
        if not _cpu_widens(layout, queries):
            return quantized_decode(layout, queries, scale)
    if turn_attention.applies(layout, queries, mask, sinks):
        return turn_attention.attention(layout, queries, scale, mask)
    return dense(layout, queries, scale, mask, sinks)


def _cpu_widens(layout: PackedLayout, queries: mx.array) -> bool:
    return queries.dtype == mx.float32 and all(
        store.bits in (None, *_FAST_WIDEN) for store in layout.bulk
    )


def _on_the_cpu_path(layout: PackedLayout, queries: mx.array) -> bool:
    """float32 on the CPU, widths it reads by bytes, float16 rows (numpy, which reads
    them, has no bfloat16); `REPRISE_CPU_ATTENTION=mlx` keeps the dense path, as it
    keeps mlx's attention for 16 bits."""
    return (
        cpu_attention.enabled
        and mx.default_device() == mx.cpu
        and _cpu_widens(layout, queries)
        and all(s.dtype == mx.float16 for s in (*layout.exact, *layout.bulk) if s.buffers)
    )


def _rotate(x: mx.array) -> mx.array:
    wide = x.astype(mx.float32) if x.dtype == mx.float16 else x
    return mx.hadamard_transform(wide, scale=1 / math.sqrt(x.shape[-1])).astype(x.dtype)


def _as(x: mx.array, dtype: mx.Dtype) -> mx.array:
    return x if x.dtype == dtype else x.astype(dtype)


# -- dense: the bulk dequantized once, then the fused attention ---------------------


def widen(store, parts: list[mx.array], dtype: mx.Dtype) -> mx.array:
    """Packed rows as `dtype`, still rotated where the store rotates."""
    if store.bits is None:
        return _as(parts[0], dtype)
    weights, scales, biases = parts
    if dtype != mx.float32 or store.bits not in _FAST_WIDEN:
        if dtype == mx.float32:
            scales, biases = scales.astype(dtype), biases.astype(dtype)
        x = mx.dequantize(weights, scales, biases, group_size=store.group_size, bits=store.bits)
        return _as(x, dtype)
    # The CPU: mlx's dequantize is scalar code; a byte view and two vector ops are
    # several times faster (little-endian packing: element i is byte i, or nibble
    # i % 2 of byte i // 2).
    codes = weights.view(mx.uint8)
    if store.bits == 4:
        codes = mx.stack([codes & 15, codes >> 4], axis=-1)
    *lead, groups = scales.shape
    codes = codes.reshape(*lead, groups, -1).astype(dtype)
    x = codes * scales[..., None].astype(dtype) + biases[..., None].astype(dtype)
    return x.reshape(*lead, groups * codes.shape[-1])


def _in_order(layout: PackedLayout, part: int, dtype: mx.Dtype, rotated: bool) -> mx.array:
    """All n positions in temporal order: sink rows, widened bulk, tail rows."""
    exact = _as(layout.exact_rows(part), dtype)
    if rotated:  # exact rows are held as they came; the bulk's keys are rotated
        exact = _rotate(exact)
    if layout.bulk_end == layout.bulk_start:
        return exact
    bulk = None
    if dtype == mx.float32 and mx.default_device() == mx.cpu:
        bulk = kvcpu.widened(layout.bulk[part], layout.bulk_start, layout.bulk_end)
    if bulk is None:
        bulk = widen(layout.bulk[part], layout.bulk_parts(part), dtype)
    sink = layout.sink_rows
    pieces = [p for p in (exact[..., :sink, :], bulk, exact[..., sink:, :]) if p.shape[2]]
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)


def dense(layout: PackedLayout, queries: mx.array, scale: float, mask, sinks=None) -> mx.array:
    dtype = queries.dtype
    keys = _in_order(layout, 0, dtype, layout.rotated)
    values = _in_order(layout, 1, dtype, False)
    if layout.rotated:
        queries = _rotate(queries)
    if cpu_attention.applies(queries, keys, sinks):
        return cpu_attention.attention(queries, keys, values, scale, mask)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


# -- decode with mx.quantized_matmul (Metal; any width) -------------------------------


def _bulk_product(store, parts: list[mx.array], x: mx.array, transpose: bool) -> mx.array:
    """x @ bulk^T (scores) or x @ bulk (values), straight from the packed rows."""
    parts = [p[:, :, None] for p in parts]  # a query-group axis, for grouped-query heads
    if store.bits is None:
        rows = _as(parts[0], x.dtype)
        return x @ (rows.swapaxes(-1, -2) if transpose else rows)
    weights, scales, biases = parts
    if x.dtype == mx.float32:
        scales, biases = scales.astype(x.dtype), biases.astype(x.dtype)
    return mx.quantized_matmul(
        x,
        weights,
        scales,
        biases,
        transpose=transpose,
        group_size=store.group_size,
        bits=store.bits,
    )


def quantized_decode(layout: PackedLayout, queries: mx.array, scale: float) -> mx.array:
    B, heads, N, D = queries.shape
    exact_k, exact_v = (_as(layout.exact_rows(p), queries.dtype)[:, :, None] for p in (0, 1))
    kv_heads = exact_k.shape[1]
    q = (queries * scale).reshape(B, kv_heads, heads // kv_heads, N, D)
    rotated = _rotate(q) if layout.rotated else q
    scores = mx.concatenate(
        [
            q @ exact_k.swapaxes(-1, -2),
            _bulk_product(layout.bulk[0], layout.bulk_parts(0), rotated, transpose=True),
        ],
        axis=-1,
    )
    weights = mx.softmax(scores, axis=-1, precise=True)
    e = exact_k.shape[3]
    out = weights[..., :e] @ exact_v + _bulk_product(
        layout.bulk[1], layout.bulk_parts(1), weights[..., e:], transpose=False
    )
    return out.reshape(B, heads, N, D)


# -- decode on the CPU: numpy on the packed buffers (app/engine/kvcpu.py) ------------


def cpu_decode(layout: PackedLayout, queries: mx.array, scale: float) -> mx.array:
    return kvcpu.decode(layout, queries, scale)
