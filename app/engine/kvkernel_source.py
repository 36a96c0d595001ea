"""The CUDA source of the decode-attention kernels (app/engine/kvkernels.py says
what they do and launches them): the bodies `mx.fast.cuda_kernel` wraps."""

PARTIALS = r"""
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
MERGE = r"""
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
