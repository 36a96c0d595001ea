"""Decode attention over the app's packed KV cache as CUDA kernels of ours
(`mx.fast.cuda_kernel`), for mlx's CUDA backend, where `quantized_matmul` is
wrong when the group size equals the head size and slow for the values
product (DESIGN §5).

Split-K ("flash decoding"): one thread block per (chunk of CHUNK tokens, KV
head, batch row). A block handles either packed bulk rows or 16-bit exact
rows (sink and tail), for all R query heads that share the KV head:

1. the query rows into shared memory, times the softmax scale; for the bulk
   of rotated keys also through the normalized Walsh-Hadamard transform
   (butterflies, the order mx.hadamard_transform uses), so the cache is never
   un-rotated;
2. one thread per token: its score from the packed key read as codes,
   score = sum_g scale_g * (q_g . codes_g) + bias_g * sum(q_g);
3. the chunk's max and sum of exp, and its exp-weighted values, read packed
   (v = scale * code + bias) by threads along the head axis;
4. a second kernel merges the chunks' (max, sum, partial output) by
   log-sum-exp, per query head and element.

Counts travel in a small int32 array and the grid follows the buffers' room
(a slot past the tokens held writes an empty partial), so shapes (and the
compiled kernels) change only when a buffer grows. The two launches run as
one `mx.compile`d function: building a `cuda_kernel` call costs the host
several times what the 16-bit attention's call does, and a decode step on a
GPU is mostly host time for small models. No Metal counterpart is written: on Metal
the app relies on `mx.quantized_matmul` (not measured here); a Metal port
should keep exactly these steps.
"""

from __future__ import annotations

import struct

import mlx.core as mx

from app.engine.kvkernel_source import MERGE, PARTIALS

CHUNK = 128  # tokens (and threads) per block
_SHARED_BYTES = 48 * 1024  # static shared memory a block may declare
stage_keys = True  # off: each thread reads its key's words from memory
compile_launches = True  # off: each call builds its launches anew (for comparison)
MAX_GROUP_HEADS = 8  # query heads per KV head the kernel is built for

_kernels: dict[str, object] = {}


def _kernel(name: str):
    if name not in _kernels:
        if name == "partials":
            _kernels[name] = mx.fast.cuda_kernel(
                name="reprise_kv_partials",
                input_names=["q", "meta", "kw", "ks", "kb", "vw", "vs", "vb", "ek", "ev"],
                output_names=["po", "pm", "pl"],
                source=PARTIALS,
                ensure_row_contiguous=False,
            )
        else:
            _kernels[name] = mx.fast.cuda_kernel(
                name="reprise_kv_merge",
                input_names=["po", "pm", "pl"],
                output_names=["out"],
                source=MERGE,
            )
    return _kernels[name]


def available() -> bool:
    """Whether mlx computes on a CUDA GPU here."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def supports(layout, queries: mx.array) -> bool:
    """The shapes the kernel is built for: packed halves of 2, 4 or 8 bits, a
    power-of-two head size the group size divides, up to 8 query heads per KV head."""
    if not available() or queries.shape[2] != 1:
        return False
    bulk_k, bulk_v = layout.bulk
    D = queries.shape[3]
    heads, kv_heads = queries.shape[1], layout.exact[0].buffers[0].shape[1]
    group = bulk_k.group_size
    return (
        bulk_k.bits in (2, 4, 8)
        and bulk_v.bits in (2, 4, 8)
        and D in (32, 64, 128, 256)
        and D % group == 0
        and group % (32 // min(bulk_k.bits, bulk_v.bits)) == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP_HEADS
    )


_last_meta: tuple[tuple, mx.array | None] = ((), None)


def _meta(values: tuple) -> mx.array:
    """The counts as a device array; every layer of a decode step has the same ones,
    so a step uploads them once instead of once per layer."""
    global _last_meta
    held = _last_meta  # read once: another thread may replace it meanwhile
    if held[0] != values:
        held = _last_meta = (values, mx.array(values, dtype=mx.int32))
    return held[1]


def _stages_keys(head_dim: int, key_bits: int, group: int, group_heads: int) -> bool:
    """Whether a block's packed keys fit in shared memory beside the rest of it."""
    rest = 4 * group_heads * (2 * head_dim + head_dim // group + CHUNK + CHUNK // 32)
    return rest + 4 * CHUNK * (head_dim * key_bits // 32 + 1) <= _SHARED_BYTES


def decode(layout, queries: mx.array, scale: float) -> mx.array:
    """Attention of one query per head over the packed layer `layout`."""
    (kw, ks, kb), (vw, vs, vb) = layout.bulk[0].buffers, layout.bulk[1].buffers
    (ek,), (ev,) = layout.exact[0].buffers, layout.exact[1].buffers
    (scale_bits,) = struct.unpack("<i", struct.pack("<f", scale))
    counts = (
        layout.bulk[0].lo + layout.bulk_start,
        layout.bulk_end - layout.bulk_start,
        layout.exact[0].lo,
        len(layout.exact[0]),
        scale_bits,
        _slots(kw),
    )
    bits = (layout.bulk[0].bits, layout.bulk[1].bits)
    config = (*bits, layout.bulk[0].group_size, layout.rotated, CHUNK, stage_keys)
    attention = _compiled((*config, compile_launches))
    return attention(queries, _meta(counts), kw, ks, kb, vw, vs, vb, ek, ev)


def _slots(buffer: mx.array) -> int:
    return -(-buffer.shape[2] // CHUNK)


_attention_fns: dict[tuple, object] = {}


def _compiled(config: tuple):
    """The two launches as one compiled function per kernel configuration. Calling a
    `cuda_kernel` builds its source and arguments anew each time, several times the
    cost of the 16-bit attention's call; a compiled function replays the traced
    launches, re-traced only when a buffer's shape changes (every few hundred
    tokens). The grid follows the buffers' room, not the tokens held, so a trace
    stays right as tokens arrive; the counts travel in `meta`."""
    if config not in _attention_fns:
        key_bits, value_bits, group, rotated, chunk, stage, compiles = config

        def launch(queries, meta, kw, ks, kb, vw, vs, vb, ek, ev):
            B, heads, _, D = queries.shape
            kv_heads = ek.shape[1]
            rows = heads // kv_heads
            chunks = _slots(kw) + _slots(ek)
            partial_shape = (B, kv_heads, chunks, rows)
            po, pm, pl = _kernel("partials")(
                inputs=[queries, meta, kw, ks, kb, vw, vs, vb, ek, ev],
                template=[
                    ("TS", ek.dtype),
                    ("D", D),
                    ("KBITS", key_bits),
                    ("VBITS", value_bits),
                    ("GROUP", group),
                    ("R", rows),
                    ("ROTATE", rotated),
                    ("CHUNK", chunk),
                    ("STAGE", stage and _stages_keys(D, key_bits, group, rows)),
                ],
                grid=(chunks * chunk, kv_heads, B),
                threadgroup=(chunk, 1, 1),
                output_shapes=[(*partial_shape, D), partial_shape, partial_shape],
                output_dtypes=[mx.float32] * 3,
            )
            (out,) = _kernel("merge")(
                inputs=[po, pm, pl],
                template=[("TQ", queries.dtype)],
                grid=(B * heads * D // 32 * 256, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[(B, heads, 1, D)],
                output_dtypes=[queries.dtype],
            )
            return out

        _attention_fns[config] = mx.compile(launch) if compiles else launch
    return _attention_fns[config]
