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

#endif
