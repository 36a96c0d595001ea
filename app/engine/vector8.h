/* What the compiled parts (kvdecode.c, packed_rows.c) share: eight floats as one
 * vector, and clones of the hot functions for the CPUs that have wider units. */
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

#endif
