/* y = x Wᵀ + b for a few rows of x: the products of decoding, one token per sequence.
 *
 * With 1 to 16 rows a float32 linear layer reads each weight once and does one or a few
 * multiply-adds with it, so its time is the time to stream the weight from memory. BLAS
 * libraries tune for larger products: on a 2-core Zen 4, MKL's float32 products of 1 to 8
 * rows by SmolLM2's weights read them at 5.5-14 GB/s, and this loop at 13-35 GB/s
 * (docs/performance.md, "Generation", few-row products). A bf16 weight (qkv.nn.packed's
 * layers) streams the same way in half the bytes (the bf16 tiles below).
 *
 * Each output is one dot product of a weight row with an input row, summed in LANES partial
 * sums (vectors along the input) and then in order, so its value depends on neither the
 * number of threads nor the other rows of x: a row's product is the same in any batch.
 * Rows go two at a time (each weight vector loaded once for both) and outputs TILE at a time,
 * which keeps TILE x 2 partial sums, TILE weight vectors and 2 input vectors in registers.
 *
 * A tile reads TILE weight rows side by side, and the hardware prefetcher alone fetches them
 * too late to keep the memory busy, so each load also prefetches the same place of the next
 * tile's rows (TILE x k floats on) into L2. A prefetch past the weight's end never faults.
 * On a 2-core Zen 4 that takes SmolLM2's products of a token from 19 to 14 ms at one row
 * (24 to 30 GB/s), 15-22 % less time at 2 to 8 rows, and 21-32 % less in the AVX2 build
 * (docs/performance.md, "Generation"). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define LANES 16
#define TILE 8
#else
#define LANES 8
#define TILE 4
#endif

typedef float lanes_f32 __attribute__((vector_size(LANES * sizeof(float))));

static inline lanes_f32 load_lanes(const float *p) {
    lanes_f32 v;
    memcpy(&v, p, sizeof v); /* an unaligned load */
    return v;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* v rounded to the nearest bf16, ties to even, as torch's float32 -> bf16 conversion: a NaN
 * stays a (quiet) NaN, a finite value past bf16's range becomes an infinity. */
static inline float round_to_bf16(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        bits = (bits | 0x00400000u) & 0xffff0000u;
    else
        bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
    memcpy(&v, &bits, sizeof v);
    return v;
}

static inline float sum_lanes(lanes_f32 v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* Outputs [o, o + count) of R rows: x (R rows, k each, row stride xs), w (n, k) contiguous
 * of WEIGHT (float or uint16_t: bf16 bits, widened by LOAD and SCALAR), y (R rows, row
 * stride ys), each sum passed through OUT before the bias. count < TILE repeats the last
 * output's weight row in the spare lanes, so that every loop keeps its constant bounds;
 * those sums are not stored. */
#define DEFINE_TILE(NAME, R, WEIGHT, LOAD, SCALAR, OUT)                                    \
    static void NAME(const float *x, int64_t xs, const WEIGHT *w, const float *bias,      \
                     int64_t k, float *y, int64_t ys, int64_t o, int64_t count) {         \
        const WEIGHT *rows_w[TILE];                                                        \
        for (int a = 0; a < TILE; a++) rows_w[a] = w + (o + (a < count ? a : count - 1)) * k; \
        lanes_f32 acc[TILE][R];                                                            \
        for (int a = 0; a < TILE; a++)                                                     \
            for (int r = 0; r < R; r++) acc[a][r] = (lanes_f32){0};                        \
        int64_t i = 0;                                                                     \
        for (; i + LANES <= k; i += LANES) {                                               \
            lanes_f32 xv[R];                                                               \
            for (int r = 0; r < R; r++) xv[r] = load_lanes(x + r * xs + i);                \
            for (int a = 0; a < TILE; a++) {                                               \
                /* The next tile's weights, into L2: see the header. */                    \
                __builtin_prefetch(rows_w[a] + i + TILE * k, 0, 1);                        \
                lanes_f32 wv = LOAD(rows_w[a] + i);                                        \
                for (int r = 0; r < R; r++) acc[a][r] += wv * xv[r];                       \
            }                                                                              \
        }                                                                                  \
        for (int a = 0; a < count; a++)                                                    \
            for (int r = 0; r < R; r++) {                                                  \
                float s = sum_lanes(acc[a][r]);                                            \
                for (int64_t j = i; j < k; j++) s += SCALAR(rows_w[a][j]) * x[r * xs + j]; \
                s = OUT(s);                                                                \
                y[r * ys + o + a] = bias ? s + bias[o + a] : s;                            \
            }                                                                              \
    }

#define SAME(v) (v)
DEFINE_TILE(tile_f32_1, 1, float, load_lanes, SAME, SAME)
DEFINE_TILE(tile_f32_2, 2, float, load_lanes, SAME, SAME)

#if defined(__AVX512BF16__)
/* With AVX512-BF16 a bf16 weight meets x, rounded to bf16 (xh), in dot products of pairs
 * (vdpbf16ps: 32 products a vector, summed in float32 with denormals as zero, as oneDNN's
 * bf16 products are): widening each weight vector to float32 first makes the loop
 * compute-bound from 4 rows on (docs/performance.md, "Generation"). Outputs as DEFINE_TILE's,
 * each sum rounded to bf16 before the bias. */
typedef uint16_t x_bf16;
#define PAIRS 32
#define DEFINE_DOT_TILE(NAME, R)                                                           \
    static void NAME(const uint16_t *xh, int64_t xs, const uint16_t *w, const float *bias, \
                     int64_t k, float *y, int64_t ys, int64_t o, int64_t count) {         \
        const uint16_t *rows_w[TILE];                                                      \
        for (int a = 0; a < TILE; a++) rows_w[a] = w + (o + (a < count ? a : count - 1)) * k; \
        __m512 acc[TILE][R];                                                               \
        for (int a = 0; a < TILE; a++)                                                     \
            for (int r = 0; r < R; r++) acc[a][r] = _mm512_setzero_ps();                   \
        int64_t i = 0;                                                                     \
        for (; i + PAIRS <= k; i += PAIRS) {                                               \
            __m512bh xv[R];                                                                \
            for (int r = 0; r < R; r++)                                                    \
                xv[r] = (__m512bh)_mm512_loadu_si512(xh + r * xs + i);                     \
            for (int a = 0; a < TILE; a++) {                                               \
                __builtin_prefetch(rows_w[a] + i + TILE * k, 0, 1);                        \
                __m512bh wv = (__m512bh)_mm512_loadu_si512(rows_w[a] + i);                 \
                for (int r = 0; r < R; r++)                                                \
                    acc[a][r] = _mm512_dpbf16_ps(acc[a][r], wv, xv[r]);                    \
            }                                                                              \
        }                                                                                  \
        for (int a = 0; a < count; a++)                                                    \
            for (int r = 0; r < R; r++) {                                                  \
                float s = _mm512_reduce_add_ps(acc[a][r]);                                 \
                for (int64_t j = i; j < k; j++)                                            \
                    s += bf16_to_f32(rows_w[a][j]) * bf16_to_f32(xh[r * xs + j]);          \
                s = round_to_bf16(s);                                                      \
                y[r * ys + o + a] = bias ? s + bias[o + a] : s;                            \
            }                                                                              \
    }
DEFINE_DOT_TILE(tile_bf16_1, 1)
DEFINE_DOT_TILE(tile_bf16_2, 2)

static inline x_bf16 x_to_bf16(float v) {
    float r = round_to_bf16(v);
    uint32_t bits;
    memcpy(&bits, &r, sizeof bits);
    return (x_bf16)(bits >> 16);
}
#else
/* Elsewhere each weight vector is widened to float32 (a shift) and meets x rounded to bf16
 * in float32 multiply-adds: the products are exact (two bf16 mantissas fit in float32's). */
typedef float x_bf16;
typedef uint16_t lanes_u16 __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t lanes_u32 __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* LANES bf16 values widened to float32: a bf16 is a float32's upper 16 bits. */
static inline lanes_f32 load_lanes_bf16(const uint16_t *p) {
    lanes_u16 h;
    memcpy(&h, p, sizeof h);
    lanes_u32 bits = __builtin_convertvector(h, lanes_u32) << 16;
    lanes_f32 v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

DEFINE_TILE(tile_bf16_1, 1, uint16_t, load_lanes_bf16, bf16_to_f32, round_to_bf16)
DEFINE_TILE(tile_bf16_2, 2, uint16_t, load_lanes_bf16, bf16_to_f32, round_to_bf16)
#define x_to_bf16 round_to_bf16
#endif

/* The output tiles of n outputs. */
static inline int64_t tiles_of(int64_t n) { return (n + TILE - 1) / TILE; }

/* One product of a group that shares x: its weight (n, k) contiguous (WEIGHT), bias (n,) or
 * NULL, and output y (rows, n). */
typedef struct {
    const void *w;
    const float *bias;
    float *y;
    int64_t n;
} product_part;

/* The outputs of `rows` rows of x (XTYPE) by each of `count` parts, their output tiles taken
 * in order as one range and split over `threads` threads of OpenMP's team, each thread a
 * contiguous part of it: one team's start for all of a group. TILE_1 and TILE_2 take one and
 * two rows. A part's tiles start at its output 0, so each output is what the part alone gives. */
#define DEFINE_PRODUCTS(NAME, XTYPE, WEIGHT, TILE_1, TILE_2)                               \
    static void NAME(const XTYPE *x, int64_t xs, const product_part *parts, int64_t count, \
                     int64_t rows, int64_t k, int64_t threads) {                          \
        int64_t tiles = 0;                                                                 \
        for (int64_t p = 0; p < count; p++) tiles += tiles_of(parts[p].n);                 \
        if (threads > tiles) threads = tiles;                                              \
        if (threads < 1) threads = 1;                                                      \
        _Pragma("omp parallel for num_threads(threads) schedule(static)")                 \
        for (int64_t part = 0; part < threads; part++) {                                   \
            const int64_t first = tiles * part / threads, end = tiles * (part + 1) / threads; \
            int64_t p = 0, before = 0; /* the part of tile `first`, and its first tile */  \
            while (tiles_of(parts[p].n) <= first - before)                                 \
                before += tiles_of(parts[p++].n);                                          \
            for (int64_t t = first; t < end; t++) {                                        \
                while (t - before == tiles_of(parts[p].n))                                 \
                    before += tiles_of(parts[p++].n);                                      \
                const WEIGHT *w = parts[p].w;                                              \
                const int64_t n = parts[p].n, o = (t - before) * TILE;                     \
                const int64_t left = n - o < TILE ? n - o : TILE;                          \
                float *y = parts[p].y;                                                     \
                int64_t r = 0;                                                             \
                for (; r + 2 <= rows; r += 2)                                              \
                    TILE_2(x + r * xs, xs, w, parts[p].bias, k, y + r * n, n, o, left);    \
                if (r < rows)                                                              \
                    TILE_1(x + r * xs, xs, w, parts[p].bias, k, y + r * n, n, o, left);    \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_PRODUCTS(products_f32, float, float, tile_f32_1, tile_f32_2)
DEFINE_PRODUCTS(products_bf16, x_bf16, uint16_t, tile_bf16_1, tile_bf16_2)

/* y_i (rows, n_i) = x (rows, k; row stride xs, unit column stride) @ w_i (n_i, k)ᵀ + b_i (n_i,)
 * or NULL, for i < count (1 to 3 products of the same x: attention's q, k and v, or a gated
 * MLP's gate and up), on `threads` threads; the unused parts NULL. Each w_i is float32, or
 * with `bf16` bf16 as a bf16 linear layer computes it: x rounded to bf16 once (a copy of rows
 * x k values, allocated here: no tensor around the call), products in float32, each sum
 * rounded to bf16, then the float32 bias. Returns 0, -1 when the bf16 copy cannot be
 * allocated (nothing written), or -2 for a count out of range. */
int qkv_few_rows_linear(const float *x, int64_t xs, int64_t rows, int64_t k, int64_t threads,
                        int64_t bf16, int64_t count,
                        const void *w0, const float *b0, float *y0, int64_t n0,
                        const void *w1, const float *b1, float *y1, int64_t n1,
                        const void *w2, const float *b2, float *y2, int64_t n2) {
    if (count < 1 || count > 3) return -2;
    const product_part parts[3] = {{w0, b0, y0, n0}, {w1, b1, y1, n1}, {w2, b2, y2, n2}};
    if (!bf16) {
        products_f32(x, xs, parts, count, rows, k, threads);
        return 0;
    }
    x_bf16 *xh = malloc((size_t)(rows * k) * sizeof *xh);
    if (xh == NULL) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < k; j++) xh[r * k + j] = x_to_bf16(x[r * xs + j]);
    products_bf16(xh, k, parts, count, rows, k, threads);
    free(xh);
    return 0;
}

/* 1 where bf16 weights meet x in AVX512-BF16 dot products, 0 where they are widened. */
int qkv_few_rows_bf16_dot_products(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}
