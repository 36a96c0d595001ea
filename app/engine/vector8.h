/* What the compiled parts (kvdecode.c, packed_rows.c, short_turn.c) share: eight and
 * sixteen floats as one vector, clones of the hot functions for the CPUs that have
 * wider units, and float16 bits widened to float32. */
#ifndef REPRISE_VECTOR8_H
#define REPRISE_VECTOR8_H

#include <stdint.h>
#include <string.h>

#define LANES 8

/* One build runs well on every x86-64 and uses AVX2 and FMA where the CPU has them.
 * GCC before 12 has no dispatcher for x86-64-v3 (the file would not build at all,
 * as with Ubuntu 22.04's GCC 11): there the clone uses AVX2 alone. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define VECTOR_CLONES_X86 1
#if __GNUC__ >= 12
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#else
#define VECTOR_CLONES
#endif

/* Eight floats in one vector (GCC and Clang lower it to what the target has: two
 * SSE or NEON registers, or one AVX one), loaded and stored unaligned. */
typedef float v8 __attribute__((vector_size(LANES * sizeof(float))));

/* The helpers that take or return a v8 are always inlined: one compiled once for
 * plain x86-64 passes a v8 in memory, while the AVX2 clone that calls it passes it
 * in a register, so a call that is not inlined (-O0, -fno-inline) reads garbage
 * pointers. Inlined, no call crosses that ABI (setup.py silences -Wpsabi's notes). */
#define VECTOR_INLINE static inline __attribute__((always_inline))

VECTOR_INLINE v8 load8(const float *p)
{
    v8 v;
    memcpy(&v, p, sizeof v);
    return v;
}

VECTOR_INLINE void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* Sixteen floats: one AVX-512 register. The functions whose tiles are built of them
 * get a clone for CPUs that have those (x86-64-v4), beside VECTOR_CLONES' AVX2 and
 * plain ones (where a v16 is two or four registers and such tiles spill). */
typedef float v16 __attribute__((vector_size(16 * sizeof(float))));

#if defined(VECTOR_CLONES_X86) && __GNUC__ >= 12
#define WIDE_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define WIDE_CLONE_BUILT 1
#else
#define WIDE_CLONES VECTOR_CLONES
#endif

VECTOR_INLINE v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

VECTOR_INLINE void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

/* Sixteen lanes' helpers, and e^x: the softmaxes of a short turn (short_turn.c) and
 * of a decode step (kvdecode.c). */
typedef int32_t v16i __attribute__((vector_size(16 * sizeof(int32_t))));

VECTOR_INLINE v16 splat(float x)
{
    return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* The lane-wise larger of a and b (C has no ?: for vectors). */
VECTOR_INLINE v16 larger(v16 a, v16 b)
{
    v16i pick_a = a > b;
    return (v16)(((v16i)a & pick_a) | ((v16i)b & ~pick_a));
}

/* e^x lane-wise, to about 2 ulp: x = n ln 2 + r with |r| <= ln 2 / 2, e^r by its
 * Taylor series to r^7, 2^n put into the exponent bits. x below -87 (the causal
 * mask's -inf among them) or NaN gives 0, as a float32 e^x underflows to nothing
 * beside a query's largest term, 1. */
VECTOR_INLINE v16 exp16(v16 x)
{
    v16i kept = x >= splat(-87.0f);
    x = larger(x, splat(-87.0f));
    x = -larger(-x, splat(-88.0f)); /* at most 88: 2^n stays finite */
    const v16 round = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (x * splat(1.44269504f) + round) - round;
    v16 r = x - n * splat(0.693145752f) - n * splat(1.42860677e-6f);
    v16 p = splat(1.0f / 5040);
    p = p * r + splat(1.0f / 720);
    p = p * r + splat(1.0f / 120);
    p = p * r + splat(1.0f / 24);
    p = p * r + splat(1.0f / 6);
    p = p * r + splat(0.5f);
    p = p * r + splat(1.0f);
    p = p * r + splat(1.0f);
    v16i scale = (__builtin_convertvector(n, v16i) + 127) << 23;
    return (v16)((v16i)(p * (v16)scale) & kept);
}

/* Whether this CPU runs the WIDE_CLONES' AVX-512 clone: elsewhere the code built of
 * sixteen-lane tiles is slower than the float32 BLAS route it replaces. */
static inline int wide_clone_runs(void)
{
#ifdef WIDE_CLONE_BUILT
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
#else
    return 0;
#endif
}

/* float16 bits as a float32: shifted 13 places up, a float16's exponent and
 * mantissa are a float32's of the value times 2^-112 (subnormals included).
 * Infinities and NaN come out finite, as in kvcpu._widen_half: a KV row never
 * holds them. */
static inline float half_to_float(uint16_t h)
{
    uint32_t magnitude = (uint32_t)(h & 0x7fff) << 13;
    float f;
    memcpy(&f, &magnitude, sizeof f);
    f *= 0x1p112f;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* packed_rows.c's helper threads, which kvdecode.c's attention shares too: see
 * `reprise_share` there. */
typedef void (*share_fn)(const void *job, int share, int shares);
int reprise_share(share_fn run, const void *job, int threads);

#endif
