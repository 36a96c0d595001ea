/* A decode step's attention over one layer of the app's packed cache, read as
 * stored: 4- or 8-bit codes with a float16 scale and bias per group of a row, or
 * float16 rows (bits 16, no scales). Called through ctypes from
 * app/engine/kvcpu.py (by way of kvnative.py, which checks every shape and stride
 * it passes); the numpy code there is the fallback where this library was not
 * built, and the oracle. Its tokens are shared with packed_rows.c's helper threads
 * (`reprise_kv_attend`).
 *
 * Why C: in numpy every product over the codes first widens them to float32 in a
 * scratch (a full write and read of four bytes a value), then hands the scratch
 * to BLAS; here each row is widened into a few hundred bytes that stay in L1 and
 * multiplied at once, so the codes are the only bytes read from memory.
 *
 * The maths, per group of a row (code c, scale s, bias b): q.(s c + b) = s (q.c)
 * + b sum(q) for the scores; for the values, sum_t w_t (s_t c_t + b_t) is
 * accumulated as (w_t s_t) c_t, with sum_t w_t b_t added per group at the end.
 *
 * Little-endian packing (mlx's): value i of a row is byte i (8 bits), or the low
 * nibble of byte i / 2 for even i and the high one for odd i (4 bits).
 */

#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "vector8.h"

/* Limits kvcpu.py checks before calling (larger shapes take the numpy path). */
#define MAX_DIM 1024
#define MAX_QUERIES 64
#define MAX_GROUPS 64

/* Row `row` of `dim` values as float32 into `out`. */
VECTOR_INLINE void widen_row(const uint8_t *restrict row, int dim, int bits,
                             float *restrict out)
{
    if (bits == 8) {
        for (int d = 0; d < dim; d++)
            out[d] = (float)row[d];
    } else if (bits == 4) {
        for (int k = 0; k < dim / 2; k++) {
            out[2 * k] = (float)(row[k] & 15);
            out[2 * k + 1] = (float)(row[k] >> 4);
        }
    } else {
        const uint16_t *halves = (const uint16_t *)row;
        for (int d = 0; d < dim; d++)
            out[d] = half_to_float(halves[d]);
    }
}


/* The lane sums of eight vectors: out[r] = sum of acc[r]'s lanes, by a tree of
 * shuffles (pairs, then quads, then halves) where the compiler has them. */
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define HAVE_SHUFFLE 1
#endif
#endif

#ifdef HAVE_SHUFFLE
#define SHUFFLE __builtin_shufflevector
VECTOR_INLINE v8 pairs(v8 a, v8 b)
{
    return SHUFFLE(a, b, 0, 8, 2, 10, 4, 12, 6, 14) + SHUFFLE(a, b, 1, 9, 3, 11, 5, 13, 7, 15);
}

VECTOR_INLINE v8 quads(v8 a, v8 b)
{
    return SHUFFLE(a, b, 0, 1, 8, 9, 4, 5, 12, 13) + SHUFFLE(a, b, 2, 3, 10, 11, 6, 7, 14, 15);
}

VECTOR_INLINE v8 lane_sums(const v8 *acc)
{
    v8 low = quads(pairs(acc[0], acc[1]), pairs(acc[2], acc[3]));
    v8 high = quads(pairs(acc[4], acc[5]), pairs(acc[6], acc[7]));
    return SHUFFLE(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}
#else
VECTOR_INLINE v8 lane_sums(const v8 *acc)
{
    v8 out;
    for (int r = 0; r < LANES; r++) {
        float sum = 0;
        for (int l = 0; l < LANES; l++)
            sum += acc[r][l];
        out[r] = sum;
    }
    return out;
}
#endif

/* Tokens go BLOCK at a time: their rows widened once into L1 and read by every
 * query, each token's products a separate chain, so the FMA units never wait on
 * one sum. */
#define BLOCK 8
_Static_assert(BLOCK == LANES, "lane_sums reduces one vector a row of a block");

/* A run of one KV head's tokens as the products read them: `tokens` rows
 * `row_stride` bytes apart; scales and biases (NULL for float16 rows) hold `groups`
 * values a token, `scale_stride` apart. */
struct run {
    const uint8_t *rows;
    ptrdiff_t row_stride;
    const uint16_t *scales, *biases;
    ptrdiff_t scale_stride;
    int tokens, dim, bits, groups;
};

/* The block of tokens from t, what both products read of it: the rows widened into
 * `wide` (BLOCK rows of `dim`, rows past the last token zeroed) and each group's
 * scales and biases into `s` and `b` (group g's at g * BLOCK; 1 and 0 for float16
 * rows). Returns how many tokens the block holds. */
VECTOR_INLINE int load_block(const struct run *run, int t, float *wide, float *s, float *b)
{
    int n = run->tokens - t < BLOCK ? run->tokens - t : BLOCK, dim = run->dim;
    for (int r = 0; r < BLOCK; r++) {
        if (r < n)
            widen_row(run->rows + (t + r) * run->row_stride, dim, run->bits, wide + r * dim);
        else
            memset(wide + r * dim, 0, dim * sizeof(float));
    }
    for (int g = 0; g < run->groups; g++)
        for (int r = 0; r < n; r++) {
            const ptrdiff_t at = (t + r) * run->scale_stride + g;
            s[g * BLOCK + r] = run->scales == NULL ? 1.0f : half_to_float(run->scales[at]);
            b[g * BLOCK + r] = run->scales == NULL ? 0.0f : half_to_float(run->biases[at]);
        }
    return n;
}

/* out[j, t] = q_j . row_t for the run's rows; q is (queries, dim), contiguous;
 * out's rows are `out_stride` apart. */
VECTOR_INLINE void head_scores(const struct run *run, const float *q, int queries, float *out,
                               ptrdiff_t out_stride)
{
    int dim = run->dim, groups = run->groups, size = dim / groups;
    float sums[MAX_QUERIES * MAX_GROUPS];
    for (int j = 0; j < queries; j++)
        for (int g = 0; g < groups; g++) {
            float sum = 0;
            for (int d = 0; d < size; d++)
                sum += q[j * dim + g * size + d];
            sums[j * groups + g] = sum;
        }
    float wide[BLOCK * MAX_DIM], s[MAX_GROUPS * BLOCK], b[MAX_GROUPS * BLOCK];
    for (int t = 0; t < run->tokens; t += BLOCK) {
        int n = load_block(run, t, wide, s, b);
        for (int g = 0; g < groups; g++) {
            const float *gs = s + g * BLOCK, *gb = b + g * BLOCK;
            for (int j = 0; j < queries; j++) {
                const float *qg = q + j * dim + g * size;
                v8 acc[BLOCK] = {{0}};
                for (int i = 0; i < size; i += LANES) {
                    v8 qv = load8(qg + i);
                    for (int r = 0; r < BLOCK; r++)
                        acc[r] += qv * load8(wide + r * dim + g * size + i);
                }
                v8 dots = lane_sums(acc);
                float *into = out + j * out_stride + t;
                for (int r = 0; r < n; r++) {
                    float score = gs[r] * dots[r] + gb[r] * sums[j * groups + g];
                    into[r] = g == 0 ? score : into[r] + score;
                }
            }
        }
    }
}

/* out[j] += sum_t w[j, t] row_t over the run's rows; w's rows are `w_stride` apart;
 * out is (queries, dim), contiguous. */
VECTOR_INLINE void head_values(const struct run *run, const float *w, ptrdiff_t w_stride,
                               int queries, float *out)
{
    int dim = run->dim, groups = run->groups, size = dim / groups;
    float bias_terms[MAX_QUERIES * MAX_GROUPS] = {0};
    float wide[BLOCK * MAX_DIM], s[MAX_GROUPS * BLOCK], b[MAX_GROUPS * BLOCK];
    for (int t = 0; t < run->tokens; t += BLOCK) {
        int n = load_block(run, t, wide, s, b);
        for (int g = 0; g < groups; g++) {
            const float *gs = s + g * BLOCK, *gb = b + g * BLOCK;
            for (int j = 0; j < queries; j++) {
                const float *weights = w + j * w_stride + t;
                float ws[BLOCK] = {0};  /* rows past n weigh nothing */
                for (int r = 0; r < n; r++) {
                    ws[r] = weights[r] * gs[r];
                    bias_terms[j * groups + g] += weights[r] * gb[r];
                }
                float *into = out + j * dim + g * size;
                for (int i = 0; i < size; i += LANES) {
                    v8 acc = load8(into + i);
                    for (int r = 0; r < BLOCK; r++)
                        acc += ws[r] * load8(wide + r * dim + g * size + i);
                    store8(into + i, acc);
                }
            }
        }
    }
    for (int j = 0; j < queries; j++)
        for (int g = 0; g < groups; g++)
            for (int d = 0; d < size; d++)
                out[j * dim + g * size + d] += bias_terms[j * groups + g];
}

/* A store of a layer's cache as `reprise_kv_attend` reads it, every KV head: the
 * arguments `head_scores` takes for head 0, and how far apart heads are
 * (rows in bytes, scales in halves). */
enum {
    ROWS, ROW_STRIDE, HEAD_STRIDE, SCALES, BIASES, SCALE_STRIDE, SCALE_HEAD_STRIDE,
    TOKENS, DIM, BITS, GROUPS, STORE_FIELDS
};

static inline const uint8_t *head_rows(const int64_t *store, int h)
{
    return (const uint8_t *)(intptr_t)store[ROWS] + h * store[HEAD_STRIDE];
}

static inline const uint16_t *head_halves(const int64_t *store, int which, int h)
{
    if (!store[which])
        return NULL;
    return (const uint16_t *)(intptr_t)store[which] + h * store[SCALE_HEAD_STRIDE];
}

/* Tokens [first, last) of KV head h of store `s`. */
VECTOR_INLINE struct run store_run(const int64_t *s, int h, int first, int last)
{
    const uint16_t *scales = head_halves(s, SCALES, h), *biases = head_halves(s, BIASES, h);
    ptrdiff_t skip = (ptrdiff_t)first * s[SCALE_STRIDE];
    return (struct run){
        head_rows(s, h) + first * s[ROW_STRIDE], s[ROW_STRIDE],
        scales ? scales + skip : NULL, biases ? biases + skip : NULL, s[SCALE_STRIDE],
        last - first, (int)s[DIM], (int)s[BITS], (int)s[GROUPS]};
}

/* row[0 .. n) -> e^(row - its maximum), in place; their sum, and the maximum into
 * `top` (-inf, and a sum of 0, for a row that sees nothing; NaN for a row holding a
 * NaN or +inf, which the join passes on, as numpy's softmax does). */
VECTOR_INLINE float exp_row(float *row, int n, float *top)
{
    v16 tops = splat(-INFINITY);
    v16i broken = {0};
    int full = n - n % 16;
    for (int i = 0; i < full; i += 16) {
        v16 x = load16(row + i);
        broken |= x != x;
        tops = larger(tops, x);
    }
    float most = -INFINITY;
    int nan = 0;
    for (int l = 0; l < 16; l++) {
        most = tops[l] > most ? tops[l] : most;
        nan |= broken[l];
    }
    for (int i = full; i < n; i++) {
        most = row[i] > most ? row[i] : most;
        nan |= row[i] != row[i];
    }
    if (nan || most == INFINITY) {
        *top = NAN;
        return NAN;
    }
    *top = most;
    if (most == -INFINITY) {
        memset(row, 0, (size_t)n * sizeof(float));
        return 0;
    }
    v16 sums = splat(0.0f);
    for (int i = 0; i < full; i += 16) {
        v16 e = exp16(load16(row + i) - splat(most));
        store16(row + i, e);
        sums += e;
    }
    float tail[16];
    for (int l = 0; l < 16; l++)
        tail[l] = full + l < n ? row[full + l] - most : -INFINITY;
    v16 e = exp16(load16(tail));
    memcpy(row + full, &e, (size_t)(n - full) * sizeof(float));
    sums += e; /* past n: e^-inf, 0 */
    float total = 0;
    for (int l = 0; l < 16; l++)
        total += sums[l];
    return total;
}

/* One layer's decode attention, shared by threads along the tokens: each share
 * takes a run of every head's exact rows and of its bulk rows, and leaves its
 * queries' value sums (weighted by e^(score - its own maximum)), the weights' sum
 * and that maximum in its part of `work`; `reprise_kv_attend` joins the shares. */
struct attend_job {
    const int64_t *keys[2], *values[2]; /* the exact rows', then the bulk's */
    const float *query[2];              /* q for the exact rows, bulk_q for the bulk */
    int kv_heads, queries;
    float *work;
};

static inline int part_tokens(const struct attend_job *a, int part)
{
    return (int)a->keys[part][TOKENS];
}

/* The floats of a share's part of `work`, when the tokens go to `shares` shares. */
static inline ptrdiff_t share_floats(const struct attend_job *a, int shares)
{
    ptrdiff_t rows = 0;
    for (int part = 0; part < 2; part++)
        rows += (part_tokens(a, part) + shares - 1) / shares;
    ptrdiff_t sums = (ptrdiff_t)a->kv_heads * a->queries;
    return a->queries * rows + sums * (a->values[1][DIM] + 2);
}

/* Share `share`'s part of `work`: its scores first, then at the part's end each
 * (head, query)'s value sums, maximum and weights' sum. */
struct share_part {
    float *scores, *partial, *tops, *sums;
};

static inline struct share_part share_part(const struct attend_job *a, int share, int shares)
{
    ptrdiff_t per = share_floats(a, shares), count = (ptrdiff_t)a->kv_heads * a->queries;
    float *scores = a->work + share * per;
    float *partial = scores + per - count * (a->values[1][DIM] + 2);
    return (struct share_part){scores, partial, partial + count * a->values[1][DIM],
                               scores + per - count};
}

VECTOR_CLONES
static void attend_share(const void *job, int share, int shares)
{
    const struct attend_job *a = job;
    int first[2], last[2], rows = 0, queries = a->queries;
    for (int part = 0; part < 2; part++) {
        first[part] = (int)((int64_t)part_tokens(a, part) * share / shares);
        last[part] = (int)((int64_t)part_tokens(a, part) * (share + 1) / shares);
        rows += last[part] - first[part];
    }
    int key_dim = (int)a->keys[1][DIM], value_dim = (int)a->values[1][DIM];
    struct share_part mine = share_part(a, share, shares);
    float *scores = mine.scores;
    for (int h = 0; h < a->kv_heads; h++) {
        float *into = mine.partial + (ptrdiff_t)h * queries * value_dim;
        int at = 0;
        for (int part = 0; part < 2; part++) {
            struct run run = store_run(a->keys[part], h, first[part], last[part]);
            if (run.tokens > 0)
                head_scores(&run, a->query[part] + (ptrdiff_t)h * queries * key_dim, queries,
                            scores + at, rows);
            at += last[part] - first[part];
        }
        for (int j = 0; j < queries; j++)
            mine.sums[h * queries + j] = exp_row(scores + (ptrdiff_t)j * rows, rows,
                                                 &mine.tops[h * queries + j]);
        memset(into, 0, (size_t)queries * value_dim * sizeof(float));
        at = 0;
        for (int part = 0; part < 2; part++) {
            struct run run = store_run(a->values[part], h, first[part], last[part]);
            if (run.tokens > 0)
                head_values(&run, scores + at, rows, queries, into);
            at += last[part] - first[part];
        }
    }
}

/* The shares' sums joined into `out` (kv_heads, queries, value dim): each share's
 * weighted by e^(its maximum - the largest), over the weights' sums so weighted. */
static void join_shares(const struct attend_job *a, int shares, float *out)
{
    ptrdiff_t count = (ptrdiff_t)a->kv_heads * a->queries;
    int value_dim = (int)a->values[1][DIM];
    for (ptrdiff_t hj = 0; hj < count; hj++) {
        float most = -INFINITY, total = 0;
        for (int s = 0; s < shares && !isnan(most); s++) {
            float top = share_part(a, s, shares).tops[hj];
            most = top > most || isnan(top) ? top : most;
        }
        float *into = out + hj * value_dim;
        for (int d = 0; d < value_dim; d++)
            into[d] = isnan(most) ? NAN : 0.0f;
        if (isnan(most))
            continue; /* a NaN or +inf score: no weights to give */
        for (int s = 0; s < shares; s++) {
            struct share_part part = share_part(a, s, shares);
            if (!(part.tops[hj] > -INFINITY))
                continue; /* a share that saw nothing */
            float weight = exp16(splat(part.tops[hj] - most))[0];
            total += part.sums[hj] * weight;
            for (int d = 0; d < value_dim; d++)
                into[d] += weight * part.partial[hj * value_dim + d];
        }
        for (int d = 0; total > 0 && d < value_dim; d++)
            into[d] /= total;
    }
}

/* Tokens below which a layer's attention is not shared: waking a helper costs more. */
#define SHARED_FROM 256

/* A decode step's attention of one layer, every KV head at once, on up to `threads`
 * threads (packed_rows.c's helpers): `queries` query rows a head (q, and bulk_q for
 * the bulk's rotated keys: (kv_heads, queries, key dim), contiguous) against its
 * exact rows then its bulk rows, one softmax over both, their values weighted, over
 * the softmax's total. `stores`: exact keys, exact values, bulk keys, bulk values,
 * STORE_FIELDS each. out: (kv_heads, queries, value dim), contiguous; a query that
 * sees nothing gets zeros. What kvcpu.py's numpy code does. False where there is no
 * memory for the shares' sums. */
int reprise_kv_attend(const int64_t *stores, int kv_heads, const float *q, const float *bulk_q,
                      int queries, int threads, float *out)
{
    struct attend_job a = {
        {stores, stores + 2 * STORE_FIELDS}, {stores + STORE_FIELDS, stores + 3 * STORE_FIELDS},
        {q, bulk_q}, kv_heads, queries, NULL};
    threads = threads < 1 ? 1 : threads;
    int tokens = part_tokens(&a, 0) + part_tokens(&a, 1);
    /* room for any number of shares up to `threads` (`share_floats` rounds up) */
    ptrdiff_t room = threads * share_floats(&a, threads) + 2 * threads * queries;
    a.work = malloc((size_t)room * sizeof(float));
    if (a.work == NULL)
        return 0;
    int shares = tokens >= SHARED_FROM ? reprise_share(attend_share, &a, threads) : 0;
    if (shares == 0) {
        shares = 1;
        attend_share(&a, 0, 1);
    }
    join_shares(&a, shares, out);
    free(a.work);
    return 1;
}

/* `runs` runs of `count` float16 values, run r at src + r * src_stride, as float32 one
 * after another into dst: a float16 cache's rows for the products of a short turn's
 * query rows (kvcpu.widened). 0.08 ms for a layer's 4k rows of keys here, against
 * 0.8-0.9 ms for mlx's and numpy's casts. */
VECTOR_CLONES
void reprise_kv_widen_halves(const uint16_t *src, ptrdiff_t src_stride, ptrdiff_t runs,
                             ptrdiff_t count, float *dst)
{
    for (ptrdiff_t r = 0; r < runs; r++) {
        const uint16_t *in = src + r * src_stride;
        float *out = dst + r * count;
        for (ptrdiff_t i = 0; i < count; i++)
            out[i] = half_to_float(in[i]);
    }
}

/* The version of the functions' arguments: kvnative.py refuses a library of another
 * (a stale build beside newer Python) rather than call it wrongly. */
#ifndef REPRISE_KV_ABI
#define REPRISE_KV_ABI 5
#endif

/* The limits above and the version, for kvnative.py to check against. */
int reprise_kv_limit(int which)
{
    switch (which) {
    case 0: return MAX_DIM;
    case 1: return MAX_QUERIES;
    case 2: return MAX_GROUPS;
    case 3: return LANES;
    default: return REPRISE_KV_ABI;
    }
}

/* Built as an extension module so that packaging finds it with the package; it is
 * loaded through ctypes and has no Python functions. */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvdecode", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__kvdecode(void) { return PyModule_Create(&module); }
