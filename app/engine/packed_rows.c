/* One row through a layer's weights as mlx stores them quantized: y = W x, W's
 * rows packed 4 or 8 bits a value (affine: a scale and a bias per group of a
 * row). Called through ctypes from app/engine/packed_rows.py, which checks every
 * shape it passes, for the one-row products of the CPU path's decode step.
 *
 * Why: the CPU path runs float32 weights dequantized at load (prefill is products
 * of many rows, fast in float32 BLAS; mlx's float16 arithmetic is emulated on the
 * CPU). A decode step's one row reads every weight once: the starter's 540 MB in
 * float32, a seventh of that as stored. Here the codes are widened in registers
 * and multiplied at once, so they are the only weight bytes read from memory.
 *
 * The maths, per group of a row (codes c, scale s, bias b): w.x = s (c.x) + b sum(x).
 * Little-endian packing (mlx's): value i of a row is the `bits` bits from bit
 * (i % per) * bits of the row's 32-bit word i / per, per = 32 / bits.
 *
 * Threads: the rows are shared among `threads` threads, the caller and helpers
 * that wait for the next product, spinning a while, then asleep. One product uses
 * them at a time; a caller that finds them busy (another thread's product) does
 * its own alone.
 */

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vector8.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mlx packs its codes little-endian; so does the reading here"
#endif

#define MAX_THREADS 16
#define ROW_BLOCK 4 /* rows multiplied together: each x chunk loaded once for them */
/* How a helper waits for the next product: SPIN polls (about 0.1 ms: the gaps
 * between a layer's products are shorter), then up to YIELDS polls each after a
 * sched_yield (milliseconds: a decode step's attention between a layer's products
 * took 0.15-0.5 ms), then asleep. Woken from sleep, a helper came late to every
 * layer's output projection: 40 tok/s at 1k tokens, against 52-53 with the yields
 * (two rounds alternated); the yields give the core to any other thread that wants
 * it. Spinning that long without yielding held a core that the attention's OpenBLAS
 * threads wanted at 4k tokens (43.8 against 35.3 ms a step, 10 rounds alternated).
 * Threads of this process about to want the cores park the helpers at once
 * (`reprise_packed_park`). */
#ifndef SPIN
#define SPIN 5000
#endif
#ifndef YIELDS
#define YIELDS 20000
#endif

typedef uint32_t v8u __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef int32_t v8i __attribute__((vector_size(LANES * sizeof(int32_t))));

struct product {
    const uint32_t *codes;
    const float *scales, *biases, *x, *sums; /* sums: of x over each group */
    int rows, words, groups, group, bits;
    float *y;
    int n;          /* rows of x: one (y = W x), or more (`many_rows`) */
    float *scratch; /* `many_rows`: each share's widened block of W */
};

/* Values 8k..8k+7 of a row at 4 bits: one word, each lane shifted to its nibble. */
VECTOR_INLINE v8 widen4(uint32_t word)
{
    const v8u shifts = {0, 4, 8, 12, 16, 20, 24, 28};
    v8u w = {word, word, word, word, word, word, word, word};
    return __builtin_convertvector((v8i)((w >> shifts) & 15u), v8);
}

/* Words k..k+7 of a row at 8 bits, value j of each (values 4l + j of the 32). */
VECTOR_INLINE v8 byte_j(v8u words, const int j)
{
    return __builtin_convertvector((v8i)((words >> (uint32_t)(8 * j)) & 255u), v8);
}

VECTOR_INLINE v8u load8u(const uint32_t *p)
{
    v8u v;
    memcpy(&v, p, sizeof v);
    return v;
}

VECTOR_INLINE float lane_sum(v8 v)
{
    float sum = 0;
    for (int l = 0; l < LANES; l++)
        sum += v[l];
    return sum;
}

/* Group g of rows `rows[0..n)` (n <= ROW_BLOCK) against x: the codes' dot products.
 * 4 bits: each word's eight values against eight of x, the word in every lane
 * shifted to its own nibble. 8 bits: eight words (32 values) at once, value j of
 * each word against x permuted so that those eight values are adjacent (building a
 * vector of two words, each in four lanes, went through the stack, and each load
 * waited on the stores before it: 10x slower). */
VECTOR_INLINE void group_dots(const struct product *p, const uint32_t **rows, int n,
                              ptrdiff_t g, v8 *acc, const int bits)
{
    if (bits == 4) {
        const ptrdiff_t words = p->group / LANES;
        for (ptrdiff_t k = g * words; k < (g + 1) * words; k++) {
            v8 xv = load8(p->x + k * LANES);
            for (int r = 0; r < n; r++)
                acc[r] += widen4(rows[r][k]) * xv;
        }
        return;
    }
    const ptrdiff_t loads = p->group / 32; /* eight words each */
    for (ptrdiff_t k = g * loads; k < (g + 1) * loads; k++) {
        const float *xs = p->x + k * 32;
        v8 x0 = load8(xs), x1 = load8(xs + 8), x2 = load8(xs + 16), x3 = load8(xs + 24);
        for (int r = 0; r < n; r++) {
            v8u words = load8u(rows[r] + k * LANES);
            acc[r] += byte_j(words, 0) * x0 + byte_j(words, 1) * x1 + byte_j(words, 2) * x2 +
                      byte_j(words, 3) * x3;
        }
    }
}

/* Rows [first, first + n) (n <= ROW_BLOCK) at `bits`: per group, the dots scaled,
 * and the group's bias times the sum of x over it. */
VECTOR_INLINE void row_block(const struct product *p, int first, int n, const int bits)
{
    const uint32_t *rows[ROW_BLOCK];
    v8 total[ROW_BLOCK] = {{0}};
    float bias[ROW_BLOCK] = {0};
    for (int r = 0; r < n; r++)
        rows[r] = p->codes + (ptrdiff_t)(first + r) * p->words;
    for (ptrdiff_t g = 0; g < p->groups; g++) {
        v8 acc[ROW_BLOCK] = {{0}};
        group_dots(p, rows, n, g, acc, bits);
        for (int r = 0; r < n; r++) {
            ptrdiff_t at = (ptrdiff_t)(first + r) * p->groups + g;
            total[r] += p->scales[at] * acc[r];
            bias[r] += p->biases[at] * p->sums[g];
        }
    }
    for (int r = 0; r < n; r++)
        p->y[first + r] = lane_sum(total[r]) + bias[r];
}

/* n and bits are constants where row_block is inlined: its sums stay in registers. */
VECTOR_CLONES
static void product_rows(const struct product *p, int start, int stop)
{
    int first = start;
    for (; first + ROW_BLOCK <= stop; first += ROW_BLOCK) {
        if (p->bits == 4)
            row_block(p, first, ROW_BLOCK, 4);
        else
            row_block(p, first, ROW_BLOCK, 8);
    }
    for (; first < stop; first++) {
        if (p->bits == 4)
            row_block(p, first, 1, 4);
        else
            row_block(p, first, 1, 8);
    }
}

/* Row r of W as float32 into `out`: each group's codes times its scale plus its bias. */
VECTOR_INLINE void widen_row(const struct product *p, ptrdiff_t r, float *out)
{
    const uint32_t *row = p->codes + r * p->words;
    for (ptrdiff_t g = 0; g < p->groups; g++) {
        const float s = p->scales[r * p->groups + g], b = p->biases[r * p->groups + g];
        const ptrdiff_t first = g * p->group;
        if (p->bits == 4) {
            for (ptrdiff_t k = first / 8; k < (first + p->group) / 8; k++)
                store8(out + 8 * k, widen4(row[k]) * s + b);
        } else { /* little-endian: value i of a row is its byte i */
            const uint8_t *bytes = (const uint8_t *)row;
            for (ptrdiff_t i = first; i < first + p->group; i++)
                out[i] = (float)bytes[i] * s + b;
        }
    }
}

/* A few rows of x through W at once (a short turn's prompt): y[i * rows + r] = W_r .
 * x_i. float32 products read four times the codes' bytes; here each block of
 * MANY_W rows of W is widened into `wide` (cache-resident), then multiplied by x
 * MANY_X rows at a time in sixteen-lane vectors (one AVX-512 register: a clone for
 * CPUs that have them), each loaded vector used by four multiply-adds. Columns: a
 * multiple of 16. */
#define MANY_W 4
#define MANY_X 4

WIDE_CLONES
static void many_rows(const struct product *p, int start, int stop, float *wide)
{
    const ptrdiff_t columns = (ptrdiff_t)p->groups * p->group;
    for (int first = start; first < stop; first += MANY_W) {
        int m = stop - first < MANY_W ? stop - first : MANY_W;
        for (int r = 0; r < MANY_W; r++) {
            if (r < m)
                widen_row(p, first + r, wide + r * columns);
            else
                memset(wide + r * columns, 0, columns * sizeof(float));
        }
        for (int i = 0; i < p->n; i += MANY_X) {
            int k = p->n - i < MANY_X ? p->n - i : MANY_X;
            const float *xs[MANY_X];
            for (int j = 0; j < MANY_X; j++) /* a short last tile repeats its last row */
                xs[j] = p->x + (i + (j < k ? j : k - 1)) * columns;
            v16 acc[MANY_W][MANY_X] = {{{0}}};
            for (ptrdiff_t c = 0; c < columns; c += 16) {
                v16 w[MANY_W], x[MANY_X];
                for (int r = 0; r < MANY_W; r++)
                    w[r] = load16(wide + r * columns + c);
                for (int j = 0; j < MANY_X; j++)
                    x[j] = load16(xs[j] + c);
                for (int r = 0; r < MANY_W; r++)
                    for (int j = 0; j < MANY_X; j++)
                        acc[r][j] += w[r] * x[j];
            }
            for (int r = 0; r < m; r++)
                for (int j = 0; j < k; j++) {
                    float sum = 0;
                    for (int l = 0; l < 16; l++)
                        sum += acc[r][j][l];
                    p->y[(ptrdiff_t)(i + j) * p->rows + first + r] = sum;
                }
        }
    }
}

/* Share `index` of `shares`: whole row blocks, as even as they come. */
static void product_share(const struct product *p, int index, int shares)
{
    int blocks = (p->rows + ROW_BLOCK - 1) / ROW_BLOCK;
    int start = blocks * index / shares * ROW_BLOCK;
    int stop = blocks * (index + 1) / shares * ROW_BLOCK;
    stop = stop < p->rows ? stop : p->rows;
    if (p->n > 1)
        many_rows(p, start, stop, p->scratch + (ptrdiff_t)index * MANY_W * p->groups * p->group);
    else
        product_rows(p, start, stop);
}

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* The helpers. `given[i]` counts the products handed to helper i: a product on
 * `shares` threads bumps those of helpers 1 .. shares - 1 only, and waits for those
 * to count `pending` down. Helpers past the shares sleep on, and are not waited
 * for (a pool once started for 8 threads and then asked for 2 waited for all 7,
 * 8x slower). */
static struct {
    pthread_mutex_t busy; /* held by the product using the helpers */
    pthread_mutex_t lock; /* with `wake`: a sleeping helper misses no product */
    pthread_cond_t wake[MAX_THREADS]; /* each helper's own: a broadcast woke them all */
    atomic_uint given[MAX_THREADS];
    atomic_int pending;
    int helpers; /* started so far */
    unsigned started_at[MAX_THREADS]; /* `given[i]` when helper i was started */
    share_fn run; /* what the helpers run now: run(job, share, shares) */
    const void *job;
    int shares;
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER, .lock = PTHREAD_MUTEX_INITIALIZER};

/* Cleared by `reprise_packed_park`, set again by the next product. */
static atomic_int may_spin = 1;

static unsigned next_product(int index, unsigned seen)
{
    atomic_uint *given = &pool.given[index];
    unsigned now = atomic_load_explicit(given, memory_order_acquire);
    for (int spin = 0; now == seen && spin < SPIN + YIELDS; spin++) {
        if (!atomic_load_explicit(&may_spin, memory_order_relaxed))
            break;
        if (spin < SPIN)
            relax();
        else
            sched_yield();
        now = atomic_load_explicit(given, memory_order_acquire);
    }
    if (now == seen) {
        pthread_mutex_lock(&pool.lock);
        while ((now = atomic_load_explicit(given, memory_order_acquire)) == seen)
            pthread_cond_wait(&pool.wake[index], &pool.lock);
        pthread_mutex_unlock(&pool.lock);
    }
    return now;
}

static void *helper(void *arg)
{
    int index = (int)(intptr_t)arg;
    unsigned seen = pool.started_at[index]; /* not `given` now: it may be past this */
    for (;;) {
        seen = next_product(index, seen);
        pool.run(pool.job, index, pool.shares);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
    return NULL;
}

/* At least `count` helpers (fewer where a thread cannot start); how many run. */
static int start_helpers(int count)
{
    while (pool.helpers < count) {
        pthread_t thread;
        pthread_attr_t attributes;
        pthread_attr_init(&attributes);
        pthread_attr_setdetachstate(&attributes, PTHREAD_CREATE_DETACHED);
        pool.started_at[pool.helpers + 1] = atomic_load(&pool.given[pool.helpers + 1]);
        int failed = pthread_create(&thread, &attributes, helper, (void *)(intptr_t)(pool.helpers + 1));
        pthread_attr_destroy(&attributes);
        if (failed)
            break;
        pool.helpers++;
    }
    return pool.helpers;
}

/* A child of fork has none of the parent's helpers. */
static void forget_helpers(void)
{
    pthread_mutex_t unlocked = PTHREAD_MUTEX_INITIALIZER;
    pool.busy = unlocked;
    pool.lock = unlocked;
    for (int i = 0; i < MAX_THREADS; i++)
        pthread_cond_init(&pool.wake[i], NULL);
    pool.helpers = 0;
}

static pthread_once_t once = PTHREAD_ONCE_INIT;

static void set_up(void)
{
    for (int i = 0; i < MAX_THREADS; i++)
        pthread_cond_init(&pool.wake[i], NULL);
    pthread_atfork(NULL, NULL, forget_helpers);
}

/* run(job, share, shares) for shares 0 .. shares - 1, share 0 by the caller and the
 * others by helpers at once; how many shares it made (at most `threads`), 0 where
 * the helpers are another caller's now or none could start (the caller then does
 * it all). The products here share their rows so; kvdecode.c's attention its tokens. */
int reprise_share(share_fn run, const void *job, int threads)
{
    if (threads > MAX_THREADS - 1)
        threads = MAX_THREADS - 1;
    if (threads < 2)
        return 0;
    pthread_once(&once, set_up);
    if (pthread_mutex_trylock(&pool.busy) != 0)
        return 0;
    int helpers = start_helpers(threads - 1);
    if (helpers == 0) {
        pthread_mutex_unlock(&pool.busy);
        return 0;
    }
    atomic_store_explicit(&may_spin, 1, memory_order_relaxed);
    pool.job = job;
    pool.run = run;
    pool.shares = threads < helpers + 1 ? threads : helpers + 1;
    int shares = pool.shares;
    atomic_store_explicit(&pool.pending, shares - 1, memory_order_relaxed);
    pthread_mutex_lock(&pool.lock);
    for (int i = 1; i < shares; i++)
        atomic_fetch_add_explicit(&pool.given[i], 1, memory_order_release);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 1; i < shares; i++)
        pthread_cond_signal(&pool.wake[i]);
    run(job, 0, shares);
    /* A helper not running (more threads than free cores: the window's, OpenBLAS's)
     * is given the core after a while, not spun against for a whole time slice. */
    for (int spin = 0; atomic_load_explicit(&pool.pending, memory_order_acquire) > 0; spin++)
        if (spin < SPIN)
            relax();
        else
            sched_yield();
    pthread_mutex_unlock(&pool.busy);
    return shares;
}

static void product_job(const void *job, int share, int shares)
{
    product_share(job, share, shares);
}

/* y = W x: W (rows, words) uint32 codes, `groups` scales and biases a row (float32,
 * contiguous), x (groups * group) float32; bits 4 (group a multiple of 8) or 8 (of
 * 32). False where there is no memory for the scratch. An infinite value of x gives
 * NaN where a float32 product gives an infinity (0 codes times it): either way the
 * step's output is unusable. */
int reprise_packed_gemv(const uint32_t *codes, const float *scales, const float *biases,
                        const float *x, int rows, int groups, int group, int bits, float *y,
                        int threads)
{
    int columns = groups * group;
    float *scratch = malloc((size_t)(columns + groups) * sizeof(float));
    if (scratch == NULL)
        return 0;
    float *sums = scratch + columns;
    for (int g = 0; g < groups; g++) {
        float sum = 0;
        for (int i = 0; i < group; i++)
            sum += x[g * group + i];
        sums[g] = sum;
    }
    if (bits == 8) /* group_dots' order: per 32 values, value 4l + j at 8j + l */
        for (int at = 0; at < columns; at += 32)
            for (int l = 0; l < LANES; l++)
                for (int j = 0; j < 4; j++)
                    scratch[at + 8 * j + l] = x[at + 4 * l + j];
    struct product p = {codes, scales, biases, bits == 8 ? scratch : x, sums, rows,
                        columns * bits / 32, groups, group, bits, y, 1, NULL};
    if (rows < 2 * ROW_BLOCK || !reprise_share(product_job, &p, threads))
        product_rows(&p, 0, rows);
    free(scratch);
    return 1;
}

/* y = x W^T for `n` >= 2 rows of x (n, groups * group), contiguous, y (n, rows): W
 * as for `reprise_packed_gemv`, its columns a multiple of 16. False for fewer rows,
 * or where there is no memory for the scratch. */
int reprise_packed_rows(const uint32_t *codes, const float *scales, const float *biases,
                        const float *x, int n, int rows, int groups, int group, int bits,
                        float *y, int threads)
{
    if (n < 2) /* one row is `reprise_packed_gemv`'s (its x laid out for it) */
        return 0;
    if (threads > MAX_THREADS - 1)
        threads = MAX_THREADS - 1;
    if (threads < 1)
        threads = 1;
    size_t share = (size_t)MANY_W * groups * group;
    float *scratch = malloc(share * threads * sizeof(float));
    if (scratch == NULL)
        return 0;
    struct product p = {codes, scales, biases, x, NULL, rows, groups * group * bits / 32,
                        groups, group, bits, y, n, scratch};
    if (threads < 2 || rows < 2 * ROW_BLOCK || !reprise_share(product_job, &p, threads))
        product_share(&p, 0, 1);
    free(scratch);
    return 1;
}

/* Rows [start, stop) of W widened to float32, out (rows, groups * group): where a
 * model keeps only its codes, a product of many rows runs through BLAS on this
 * (a scratch reused per product), one layer's weight at a time. */
VECTOR_CLONES
static void widen_rows(const struct product *p, int start, int stop, float *out)
{
    const ptrdiff_t columns = (ptrdiff_t)p->groups * p->group;
    for (ptrdiff_t r = start; r < stop; r++)
        widen_row(p, r, out + r * columns);
}

/* W as float32 into `out` (rows, groups * group), the rows shared like a product's. */
void reprise_packed_widen(const uint32_t *codes, const float *scales, const float *biases,
                          int rows, int groups, int group, int bits, float *out)
{
    struct product p = {codes, scales, biases, NULL, NULL, rows, groups * group * bits / 32,
                        groups, group, bits, NULL, 0, NULL};
    widen_rows(&p, 0, rows, out);
}

/* The helpers go to sleep now rather than wait on for the next product: the caller
 * is about to run threads of its own (a short turn's attention). */
void reprise_packed_park(void) { atomic_store_explicit(&may_spin, 0, memory_order_relaxed); }

/* The version of the arguments above, for packed_rows.py to check (a stale build
 * beside newer Python is refused). */
int reprise_packed_abi(void) { return 4; }

/* Whether this CPU runs the clone built for AVX2 and FMA, where the products here
 * beat float32 sgemv (a decode step 15.9 against 21.2 ms); the portable build took
 * 27.7 ms where sgemv took 21.7 (each value's shift done one lane at a time). */
int reprise_packed_fast(void)
{
#ifdef VECTOR_CLONES_X86
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* Whether this CPU runs `many_rows`' sixteen-lane clone (AVX-512), where a short
 * turn's products through the codes beat float32 sgemm; its AVX2 build spills its
 * tiles out of the sixteen registers it has. */
int reprise_packed_many_fast(void) { return wide_clone_runs(); }
