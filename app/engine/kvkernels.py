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

CHUNK = 128  # tokens (and threads) per block
_SHARED_BYTES = 48 * 1024  # static shared memory a block may declare
stage_keys = True  # off: each thread reads its key's words from memory
compile_launches = True  # off: each call builds its launches anew (for comparison)
MAX_GROUP_HEADS = 8  # query heads per KV head the kernel is built for

_PARTIALS = r"""
    constexpr int KPW = 32 / KBITS, VPW = 32 / VBITS;
    constexpr uint32_t KMASK = (1u << KBITS) - 1u, VMASK = (1u << VBITS) - 1u;
    constexpr int KW = D / KPW, VW = D / VPW, NG = D / GROUP, KG = GROUP / KPW;
    constexpr int EC = D / 8;
    constexpr float LOW = -3.0e38f;
    __shared__ float sq[R][D];
    __shared__ float sqs[R][NG];
    __shared__ float sp[R][CHUNK];
    __shared__ float sred[R][CHUNK / 32];
    __shared__ float sout[R][D];
    // The chunk's packed keys, staged with coalesced reads (one thread per token
    // reading its own row touches a cache line per thread); a padded row keeps
    // the threads of a warp on different banks.
    __shared__ uint32_t skw[STAGE ? CHUNK : 1][STAGE ? KW + 1 : 1];

    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
    const int heads = gridDim.y, chunks = gridDim.x;
    const int bulk_lo = meta[0], bulk_len = meta[1], exact_lo = meta[2], exact_len = meta[3];
    const float scale = __int_as_float(meta[4]);
    const int nq = meta[5];
    const bool quant = c < nq;
    const int first = (quant ? c : c - nq) * CHUNK;
    const int count = min(CHUNK, (quant ? bulk_len : exact_len) - first);
    const int64_t base = ((int64_t)(b * heads + h) * chunks + c) * R;
    if (count <= 0) {  // a slot past the tokens held (the grid follows the buffers' room)
        for (int i = t; i < R * D; i += CHUNK) po[base * D + i] = 0.0f;
        if (t < R) {
            pm[base + t] = LOW;
            pl[base + t] = 0.0f;
        }
        return;
    }

    for (int i = t; i < R * D; i += CHUNK) {
        const int r = i / D, d = i % D;
        const int64_t at =
            b * q_strides[0] + (int64_t)(h * R + r) * q_strides[1] + d * q_strides[3];
        sq[r][d] = static_cast<float>(q[at]) * scale;
        sout[r][d] = 0.0f;
    }
    __syncthreads();
    if (ROTATE && quant) {
        for (int len = 1; len < D; len <<= 1) {
            for (int i = t; i < R * D / 2; i += CHUNK) {
                const int r = i / (D / 2), j = i % (D / 2);
                const int lo = (j / len) * 2 * len + (j % len), hi = lo + len;
                const float x = sq[r][lo], y = sq[r][hi];
                sq[r][lo] = x + y;
                sq[r][hi] = x - y;
            }
            __syncthreads();
        }
        const float norm = rsqrtf((float)D);
        for (int i = t; i < R * D; i += CHUNK) sq[i / D][i % D] *= norm;
        __syncthreads();
    }
    if (quant) {
        for (int i = t; i < R * NG; i += CHUNK) {
            const int r = i / NG, g = i % NG;
            float s = 0.0f;
            for (int d = 0; d < GROUP; d++) s += sq[r][g * GROUP + d];
            sqs[r][g] = s;
        }
        __syncthreads();
    }

    if (STAGE && quant) {
        const int64_t row0 = (int64_t)(b * heads + h) * kw_shape[2] + bulk_lo + first;
        for (int i = t; i < count * KW; i += CHUNK) skw[i / KW][i % KW] = kw[row0 * KW + i];
        __syncthreads();
    }

    float s[R];
    #pragma unroll
    for (int r = 0; r < R; r++) s[r] = LOW;
    if (t < count) {
        #pragma unroll
        for (int r = 0; r < R; r++) s[r] = 0.0f;
        if (quant) {
            const int64_t row = (int64_t)(b * heads + h) * kw_shape[2] + bulk_lo + first + t;
            const uint32_t* w = kw + row * KW;
            for (int g = 0; g < NG; g++) {
                float acc[R];
                #pragma unroll
                for (int r = 0; r < R; r++) acc[r] = 0.0f;
                #pragma unroll
                for (int wi = 0; wi < KG; wi++) {
                    const uint32_t word = STAGE ? skw[t][g * KG + wi] : w[g * KG + wi];
                    #pragma unroll
                    for (int e = 0; e < KPW; e++) {
                        const float code = (float)((word >> (e * KBITS)) & KMASK);
                        const int d = (g * KG + wi) * KPW + e;
                        #pragma unroll
                        for (int r = 0; r < R; r++) acc[r] += sq[r][d] * code;
                    }
                }
                const float sc = static_cast<float>(ks[row * NG + g]);
                const float bi = static_cast<float>(kb[row * NG + g]);
                #pragma unroll
                for (int r = 0; r < R; r++) s[r] += sc * acc[r] + bi * sqs[r][g];
            }
        } else {
            const int64_t row = (int64_t)(b * heads + h) * ek_shape[2] + exact_lo + first + t;
            const TS* k = ek + row * D;
            for (int d = 0; d < D; d++) {
                const float x = static_cast<float>(k[d]);
                #pragma unroll
                for (int r = 0; r < R; r++) s[r] += sq[r][d] * x;
            }
        }
    }

    const int lane = t % 32, warp = t / 32;
    float m[R], total[R];
    #pragma unroll
    for (int r = 0; r < R; r++) {
        float v = s[r];
        for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
        if (lane == 0) sred[r][warp] = v;
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < R; r++) {
        float v = LOW;
        for (int i = 0; i < CHUNK / 32; i++) v = fmaxf(v, sred[r][i]);
        m[r] = v;
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < R; r++) {
        const float p = t < count ? __expf(s[r] - m[r]) : 0.0f;
        sp[r][t] = p;
        float v = p;
        for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
        if (lane == 0) sred[r][warp] = v;
    }
    __syncthreads();
    #pragma unroll
    for (int r = 0; r < R; r++) {
        float v = 0.0f;
        for (int i = 0; i < CHUNK / 32; i++) v += sred[r][i];
        total[r] = v;
    }

    if (quant) {
        const int col = t % VW, sub = t / VW;
        const int g = col * VPW / GROUP;
        float acc[R][VPW];
        #pragma unroll
        for (int r = 0; r < R; r++)
            #pragma unroll
            for (int e = 0; e < VPW; e++) acc[r][e] = 0.0f;
        for (int j = sub; j < count; j += CHUNK / VW) {
            const int64_t row = (int64_t)(b * heads + h) * vw_shape[2] + bulk_lo + first + j;
            const uint32_t word = vw[row * VW + col];
            const float sc = static_cast<float>(vs[row * NG + g]);
            const float bi = static_cast<float>(vb[row * NG + g]);
            #pragma unroll
            for (int e = 0; e < VPW; e++) {
                const float v = sc * (float)((word >> (e * VBITS)) & VMASK) + bi;
                #pragma unroll
                for (int r = 0; r < R; r++) acc[r][e] += sp[r][j] * v;
            }
        }
        #pragma unroll
        for (int r = 0; r < R; r++)
            #pragma unroll
            for (int e = 0; e < VPW; e++) atomicAdd(&sout[r][col * VPW + e], acc[r][e]);
    } else {
        const int col = t % EC, sub = t / EC;
        float acc[R][8];
        #pragma unroll
        for (int r = 0; r < R; r++)
            #pragma unroll
            for (int e = 0; e < 8; e++) acc[r][e] = 0.0f;
        for (int j = sub; j < count; j += CHUNK / EC) {
            const int64_t row = (int64_t)(b * heads + h) * ev_shape[2] + exact_lo + first + j;
            const TS* v = ev + row * D + col * 8;
            #pragma unroll
            for (int e = 0; e < 8; e++) {
                const float x = static_cast<float>(v[e]);
                #pragma unroll
                for (int r = 0; r < R; r++) acc[r][e] += sp[r][j] * x;
            }
        }
        #pragma unroll
        for (int r = 0; r < R; r++)
            #pragma unroll
            for (int e = 0; e < 8; e++) atomicAdd(&sout[r][col * 8 + e], acc[r][e]);
    }
    __syncthreads();

    for (int i = t; i < R * D; i += CHUNK) po[base * D + i] = sout[i / D][i % D];
    if (t < R) {
        pm[base + t] = m[t];
        pl[base + t] = total[t];
    }
"""

# The merge: one block per query head and 32 output elements, its 8 warps taking
# every 8th chunk (one thread per element walking every chunk was a long chain of
# loads at 16k tokens and more).
_MERGE = r"""
    const int chunks = pm_shape[2], R = pm_shape[3], D = po_shape[4];
    const int slices = D / 32;
    const int64_t row = blockIdx.x / slices;  // (batch * kv head) * R + query head in group
    const int d = (blockIdx.x % slices) * 32 + threadIdx.x % 32, sub = threadIdx.x / 32;
    const int r = row % R;
    const int64_t bh = row / R;
    __shared__ float stop[8], sacc[8][32], sweight[8];
    float top = -3.0e38f;
    for (int c = threadIdx.x; c < chunks; c += 256) top = fmaxf(top, pm[(bh * chunks + c) * R + r]);
    for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, off));
    if (threadIdx.x % 32 == 0) stop[sub] = top;
    __syncthreads();
    top = stop[0];
    for (int i = 1; i < 8; i++) top = fmaxf(top, stop[i]);
    float weight = 0.0f, acc = 0.0f;
    #pragma unroll 4
    for (int c = sub; c < chunks; c += 8) {
        const int64_t at = (bh * chunks + c) * R + r;
        const float w = __expf(pm[at] - top);
        weight += w * pl[at];
        acc += w * po[at * D + d];
    }
    sacc[sub][threadIdx.x % 32] = acc;
    if (threadIdx.x % 32 == 0) sweight[sub] = weight;
    __syncthreads();
    if (sub == 0) {
        float a = 0.0f, w = 0.0f;
        for (int i = 0; i < 8; i++) {
            a += sacc[i][threadIdx.x];
            w += sweight[i];
        }
        out[row * D + d] = static_cast<TQ>(a / w);
    }
"""

_kernels: dict[str, object] = {}


def _kernel(name: str):
    if name not in _kernels:
        if name == "partials":
            _kernels[name] = mx.fast.cuda_kernel(
                name="reprise_kv_partials",
                input_names=["q", "meta", "kw", "ks", "kb", "vw", "vs", "vb", "ek", "ev"],
                output_names=["po", "pm", "pl"],
                source=_PARTIALS,
                ensure_row_contiguous=False,
            )
        else:
            _kernels[name] = mx.fast.cuda_kernel(
                name="reprise_kv_merge",
                input_names=["po", "pm", "pl"],
                output_names=["out"],
                source=_MERGE,
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
    if _last_meta[0] != values:
        _last_meta = (values, mx.array(values, dtype=mx.int32))
    return _last_meta[1]


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
