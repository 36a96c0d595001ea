/* A short turn's attention products over one KV head of float16 rows, or of rows
 * packed 4 or 8 bits a value (the app's quantized bulk): the few
 * query rows of a follow-up message (times the query heads that share the KV
 * head) against every cached token. Called through ctypes from
 * app/engine/kvcpu.py, which checks every shape and stride it passes; mlx's
 * products (OpenBLAS on rows widened to float32) are the fallback and the oracle.
 *
 * Why: a follow-up of 17 tokens at 4k tokens of history is, per layer, 51
 * queries a KV head against 4,096 rows, twice (scores, then values): compute-
 * bound, and OpenBLAS ran it at about 46 G multiply-adds a second in eight-lane
 * vectors, after a float32 copy of the rows. Here the rows are widened a few at
 * a time into L1 and the products run in sixteen-lane vectors where the CPU has
 * them (AVX-512), each loaded value used by several multiply-adds.
 *
 * Both products keep the queries on the vector lanes, so no sum across lanes is
 * ever needed (a head of 64 dimensions is too short for that to pay):
 * - scores, token-major: st[t][j] = sum_d row_t[d] q_j[d], from the queries
 *   transposed (qt[d][j]), a tile of TILE_TOKENS tokens by two vectors of queries;
 * - values: out[j][:] += sum_t pt[t][j] row_t[:], a tile of TILE_QUERIES queries
 *   by four vectors of dimensions, the weights broadcast from pt's row t.
 * The softmax between them (and the causal mask) is numpy's, on st.
 */

#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "vector8.h"

#define WIDE 16 /* lanes of a v16 */
#define MAX_DIM 1024
#define MAX_QUERIES 1024 /* a KV head's queries the softmax takes */
#define TILE_TOKENS 8
#define TILE_QUERIES 4
#define DIM_VECTORS 4 /* dimensions of a values tile: 64 */
#define VALUE_BLOCK 32 /* value rows widened at a time: 8 KB of float32 at 64 wide */

/* Where a span's rows come from: float16 rows (bits 16), or codes packed 4 or 8 bits
 * a value (mlx's little-endian packing: value d is byte d, or nibble d % 2 of byte
 * d / 2, low first) with a float16 scale and bias for each of a row's `groups`. */
struct turn_rows {
    const void *rows;        /* uint16 halves, or uint32 words of codes */
    ptrdiff_t stride;        /* from a token's row to the next's: halves, or words */
    const uint16_t *scales, *biases;
    ptrdiff_t scale_stride;  /* halves from a token's scales to the next's */
    int bits, groups;
};

/* Row t of packed codes as float32: each code times its group's scale plus its bias. */
static inline void widen_packed(const struct turn_rows *s, ptrdiff_t t, int dim, float *into)
{
    const uint8_t *bytes = (const uint8_t *)((const uint32_t *)s->rows + t * s->stride);
    const uint16_t *scales = s->scales + t * s->scale_stride;
    const uint16_t *biases = s->biases + t * s->scale_stride;
    const int group = dim / s->groups;
    for (int g = 0; g < s->groups; g++) {
        const float scale = half_to_float(scales[g]), bias = half_to_float(biases[g]);
        float *out = into + g * group;
        if (s->bits == 8) {
            const uint8_t *codes = bytes + g * group;
            for (int d = 0; d < group; d++)
                out[d] = (float)codes[d] * scale + bias;
        } else {
            const uint8_t *codes = bytes + g * group / 2;
            for (int d = 0; d < group / 2; d++) {
                out[2 * d] = (float)(codes[d] & 15) * scale + bias;
                out[2 * d + 1] = (float)(codes[d] >> 4) * scale + bias;
            }
        }
    }
}

/* Rows t .. t + count - 1 as float32 into `out`, `dim` apart; rows count .. block - 1
 * zeroed. */
static inline void widen_rows(const struct turn_rows *s, int t, int count, int block, int dim,
                              float *out)
{
    for (int r = 0; r < block; r++) {
        float *into = out + (ptrdiff_t)r * dim;
        if (r >= count) {
            memset(into, 0, dim * sizeof(float));
        } else if (s->bits == 16) {
            const uint16_t *row = (const uint16_t *)s->rows + (t + r) * s->stride;
            for (int d = 0; d < dim; d++)
                into[d] = half_to_float(row[d]);
        } else {
            widen_packed(s, t + r, dim, into);
        }
    }
}

/* Token-major scores (tokens x queries, queries a multiple of 16, at most
 * MAX_QUERIES) -> e^(score - its query's maximum), in place; each query's sum into
 * `totals`. Row by row, each query's running maximum and sum in a vector lane. */
WIDE_CLONES
void reprise_turn_softmax(float *st, int tokens, int queries, float *totals)
{
    v16 top[MAX_QUERIES / WIDE], sum[MAX_QUERIES / WIDE];
    int vectors = queries / WIDE;
    for (int v = 0; v < vectors; v++) {
        top[v] = splat(-INFINITY);
        sum[v] = splat(0.0f);
    }
    for (int t = 0; t < tokens; t++)
        for (int v = 0; v < vectors; v++)
            top[v] = larger(top[v], load16(st + (ptrdiff_t)t * queries + v * WIDE));
    for (int t = 0; t < tokens; t++)
        for (int v = 0; v < vectors; v++) {
            float *at = st + (ptrdiff_t)t * queries + v * WIDE;
            v16 e = exp16(load16(at) - top[v]);
            store16(at, e);
            sum[v] += e;
        }
    for (int v = 0; v < vectors; v++)
        store16(totals + v * WIDE, sum[v]);
}

/* st[t * queries + j] = row_t . q_j for `tokens` rows and `queries` queries (a
 * multiple of 32) given transposed: qt[d * queries + j]. Always inlined, into each
 * of the callers' clones: called, GCC compiled it once for plain x86-64, where its
 * sixteen-lane tiles spill (0.9 s for a 17-token turn at 4k, against 0.1). */
VECTOR_INLINE void turn_scores(const struct turn_rows *s, int tokens, int dim, const float *qt,
                               int queries, float *st)
{
    float wide[TILE_TOKENS * MAX_DIM];
    for (int t = 0; t < tokens; t += TILE_TOKENS) {
        int count = tokens - t < TILE_TOKENS ? tokens - t : TILE_TOKENS;
        widen_rows(s, t, count, TILE_TOKENS, dim, wide);
        for (int j = 0; j < queries; j += 2 * WIDE) {
            v16 acc[TILE_TOKENS][2] = {{{0}}};
            for (int d = 0; d < dim; d++) {
                v16 low = load16(qt + (ptrdiff_t)d * queries + j);
                v16 high = load16(qt + (ptrdiff_t)d * queries + j + WIDE);
                for (int r = 0; r < TILE_TOKENS; r++) {
                    float k = wide[r * dim + d];
                    acc[r][0] += k * low;
                    acc[r][1] += k * high;
                }
            }
            for (int r = 0; r < count; r++) {
                store16(st + (ptrdiff_t)(t + r) * queries + j, acc[r][0]);
                store16(st + (ptrdiff_t)(t + r) * queries + j + WIDE, acc[r][1]);
            }
        }
    }
}

/* `turn_scores` over float16 rows `stride` halves apart. */
WIDE_CLONES
void reprise_turn_scores(const uint16_t *rows, ptrdiff_t stride, int tokens, int dim,
                         const float *qt, int queries, float *st)
{
    struct turn_rows s = {rows, stride, NULL, NULL, 0, 16, 1};
    turn_scores(&s, tokens, dim, qt, queries, st);
}

/* `turn_scores` over packed rows: codes `stride` words apart, `groups` scales and
 * biases a row, `scale_stride` halves apart. */
WIDE_CLONES
void reprise_turn_scores_packed(const uint32_t *codes, ptrdiff_t stride, const uint16_t *scales,
                                const uint16_t *biases, ptrdiff_t scale_stride, int bits,
                                int groups, int tokens, int dim, const float *qt, int queries,
                                float *st)
{
    struct turn_rows s = {codes, stride, scales, biases, scale_stride, bits, groups};
    turn_scores(&s, tokens, dim, qt, queries, st);
}

/* out[j * dim + :] += sum_t pt[t * queries + j] row_t for j < used (a multiple of
 * TILE_QUERIES, at most `queries`), `tokens` rows; dim a multiple of DIM_VECTORS * 16. */
VECTOR_INLINE void turn_values(const struct turn_rows *s, int tokens, int dim, const float *pt,
                               int queries, int used, float *out)
{
    float wide[VALUE_BLOCK * MAX_DIM];
    for (int t = 0; t < tokens; t += VALUE_BLOCK) {
        int count = tokens - t < VALUE_BLOCK ? tokens - t : VALUE_BLOCK;
        widen_rows(s, t, count, count, dim, wide);
        const float *weights = pt + (ptrdiff_t)t * queries;
        for (int j = 0; j < used; j += TILE_QUERIES) {
            for (int c = 0; c < dim; c += DIM_VECTORS * WIDE) {
                v16 acc[TILE_QUERIES][DIM_VECTORS];
                for (int q = 0; q < TILE_QUERIES; q++)
                    for (int v = 0; v < DIM_VECTORS; v++)
                        acc[q][v] = load16(out + (ptrdiff_t)(j + q) * dim + c + v * WIDE);
                for (int r = 0; r < count; r++) {
                    const float *row = wide + r * dim + c;
                    v16 x[DIM_VECTORS];
                    for (int v = 0; v < DIM_VECTORS; v++)
                        x[v] = load16(row + v * WIDE);
                    for (int q = 0; q < TILE_QUERIES; q++) {
                        float w = weights[(ptrdiff_t)r * queries + j + q];
                        for (int v = 0; v < DIM_VECTORS; v++)
                            acc[q][v] += w * x[v];
                    }
                }
                for (int q = 0; q < TILE_QUERIES; q++)
                    for (int v = 0; v < DIM_VECTORS; v++)
                        store16(out + (ptrdiff_t)(j + q) * dim + c + v * WIDE, acc[q][v]);
            }
        }
    }
}

/* `turn_values` over float16 rows `stride` halves apart. */
WIDE_CLONES
void reprise_turn_values(const uint16_t *rows, ptrdiff_t stride, int tokens, int dim,
                         const float *pt, int queries, int used, float *out)
{
    struct turn_rows s = {rows, stride, NULL, NULL, 0, 16, 1};
    turn_values(&s, tokens, dim, pt, queries, used, out);
}

/* `turn_values` over packed rows, as `reprise_turn_scores_packed` reads them. */
WIDE_CLONES
void reprise_turn_values_packed(const uint32_t *codes, ptrdiff_t stride, const uint16_t *scales,
                                const uint16_t *biases, ptrdiff_t scale_stride, int bits,
                                int groups, int tokens, int dim, const float *pt, int queries,
                                int used, float *out)
{
    struct turn_rows s = {codes, stride, scales, biases, scale_stride, bits, groups};
    turn_values(&s, tokens, dim, pt, queries, used, out);
}

/* The limits above, for kvnative.py to check every call against (0: a row's width,
 * 1: a KV head's queries). */
int reprise_turn_limit(int which)
{
    return which == 0 ? MAX_DIM : MAX_QUERIES;
}

/* Whether this CPU runs the sixteen-lane clone (AVX-512). Elsewhere the tiles spill:
 * GCC 11's AVX2 build took 14.7 ms a layer of the starter at 4k tokens, where mlx's
 * route (rows widened, OpenBLAS) took 1.9. */
int reprise_turn_fast(void) { return wide_clone_runs(); }
