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

Counts travel in a small int32 array, so shapes (and the compiled kernels)
change only when a buffer grows. No Metal counterpart is written: on Metal
the app relies on `mx.quantized_matmul` (not measured here); a Metal port
should keep exactly these steps.
"""

from __future__ import annotations

import struct

import mlx.core as mx

CHUNK = 128  # tokens (and threads) per block
# Keys staged in shared memory when a chunk's packed keys take at most this much
# (8-bit up to head size 128, 4-bit up to 256); `stage_keys` off is the old read.
_STAGE_BYTES = 17 * 1024
stage_keys = True
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

    const int64_t base = ((int64_t)(b * heads + h) * chunks + c) * R;
    for (int i = t; i < R * D; i += CHUNK) po[base * D + i] = sout[i / D][i % D];
    if (t < R) {
        pm[base + t] = m[t];
        pl[base + t] = total[t];
    }
"""

_MERGE = r"""
    const int chunks = pm_shape[2], R = pm_shape[3], D = po_shape[4];
    const int64_t total = (int64_t)pm_shape[0] * pm_shape[1] * R * D;
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const int d = i % D;
    const int64_t row = i / D;  // (batch * kv head) * R + query head in group
    const int r = row % R;
    const int64_t bh = row / R;
    float top = -3.0e38f;
    for (int c = 0; c < chunks; c++) top = fmaxf(top, pm[(bh * chunks + c) * R + r]);
    float weight = 0.0f, acc = 0.0f;
    for (int c = 0; c < chunks; c++) {
        const int64_t at = (bh * chunks + c) * R + r;
        const float w = __expf(pm[at] - top);
        weight += w * pl[at];
        acc += w * po[at * D + d];
    }
    out[i] = static_cast<TQ>(acc / weight);
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


def _stages(head_dim: int, key_bits: int) -> bool:
    return stage_keys and CHUNK * (head_dim * key_bits // 32 + 1) * 4 <= _STAGE_BYTES


def decode(layout, queries: mx.array, scale: float) -> mx.array:
    """Attention of one query per head over the packed layer `layout`."""
    B, heads, _, D = queries.shape
    kw, ks, kb = layout.bulk[0].buffers
    vw, vs, vb = layout.bulk[1].buffers
    (ek,), (ev,) = layout.exact[0].buffers, layout.exact[1].buffers
    kv_heads = ek.shape[1]
    group_heads = heads // kv_heads
    bulk_len = layout.bulk_end - layout.bulk_start
    exact_len = len(layout.exact[0])
    nq = -(-bulk_len // CHUNK)
    chunks = nq + -(-exact_len // CHUNK)
    (scale_bits,) = struct.unpack("<i", struct.pack("<f", scale))
    bulk_lo, exact_lo = layout.bulk[0].lo + layout.bulk_start, layout.exact[0].lo
    meta = _meta((bulk_lo, bulk_len, exact_lo, exact_len, scale_bits, nq))
    partial_shape = (B, kv_heads, chunks, group_heads)
    po, pm, pl = _kernel("partials")(
        inputs=[queries, meta, kw, ks, kb, vw, vs, vb, ek, ev],
        template=[
            ("TS", ek.dtype),
            ("D", D),
            ("KBITS", layout.bulk[0].bits),
            ("VBITS", layout.bulk[1].bits),
            ("GROUP", layout.bulk[0].group_size),
            ("R", group_heads),
            ("ROTATE", layout.rotated),
            ("CHUNK", CHUNK),
            ("STAGE", _stages(D, layout.bulk[0].bits)),
        ],
        grid=(chunks * CHUNK, kv_heads, B),
        threadgroup=(CHUNK, 1, 1),
        output_shapes=[(*partial_shape, D), partial_shape, partial_shape],
        output_dtypes=[mx.float32] * 3,
    )
    (out,) = _kernel("merge")(
        inputs=[po, pm, pl],
        template=[("TQ", queries.dtype)],
        grid=(B * heads * D, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(B, heads, 1, D)],
        output_dtypes=[queries.dtype],
    )
    return out
