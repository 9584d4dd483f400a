/* y = x Wᵀ + b for a few rows of x: the products of decoding, one token per sequence.
 *
 * With 1 to 16 rows a float32 linear layer reads each weight once and does one or a few
 * multiply-adds with it, so its time is the time to stream the weight from memory. BLAS
 * libraries tune for larger products: on a 2-core Zen 4, MKL's float32 products of 1 to 8
 * rows by SmolLM2's weights read them at 5.5-14 GB/s, and this loop at 13-35 GB/s
 * (docs/performance.md, "Generation", few-row products).
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
#include <string.h>

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

static inline float sum_lanes(lanes_f32 v) {
    float s = 0.0f;
    for (int i = 0; i < LANES; i++) s += v[i];
    return s;
}

/* Outputs [o, o + count) of R rows: x (R rows, k each, row stride xs), w (n, k) contiguous,
 * y (R rows, row stride ys). count < TILE repeats the last output's weight row in the spare
 * lanes, so that every loop keeps its constant bounds; those sums are not stored. */
#define DEFINE_TILE(R)                                                                     \
    static void tile_##R(const float *x, int64_t xs, const float *w, const float *bias,   \
                         int64_t k, float *y, int64_t ys, int64_t o, int64_t count) {     \
        const float *rows_w[TILE];                                                         \
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
                lanes_f32 wv = load_lanes(rows_w[a] + i);                                  \
                for (int r = 0; r < R; r++) acc[a][r] += wv * xv[r];                       \
            }                                                                              \
        }                                                                                  \
        for (int a = 0; a < count; a++)                                                    \
            for (int r = 0; r < R; r++) {                                                  \
                float s = sum_lanes(acc[a][r]);                                            \
                for (int64_t j = i; j < k; j++) s += rows_w[a][j] * x[r * xs + j];         \
                y[r * ys + o + a] = bias ? s + bias[o + a] : s;                            \
            }                                                                              \
    }

DEFINE_TILE(1)
DEFINE_TILE(2)

/* y (rows, n) = x (rows, k; row stride xs, unit column stride) @ w (n, k)ᵀ + bias (n,) or
 * NULL, on `threads` threads of OpenMP's team, each taking a contiguous range of outputs. */
void qkv_few_rows_linear_f32(const float *x, int64_t xs, const float *w, const float *bias,
                             float *y, int64_t rows, int64_t k, int64_t n, int64_t threads) {
    const int64_t tiles = (n + TILE - 1) / TILE;
    if (threads > tiles) threads = tiles;
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t part = 0; part < threads; part++) {
        const int64_t first = tiles * part / threads * TILE;
        int64_t end = tiles * (part + 1) / threads * TILE;
        if (end > n) end = n;
        for (int64_t o = first; o < end; o += TILE) {
            const int64_t count = end - o < TILE ? end - o : TILE;
            int64_t r = 0;
            for (; r + 2 <= rows; r += 2)
                tile_2(x + r * xs, xs, w, bias, k, y + r * n, n, o, count);
            if (r < rows) tile_1(x + r * xs, xs, w, bias, k, y + r * n, n, o, count);
        }
    }
}
