/* The negative L1 kernel -sum_d |q_d - k_d| on CPU tiles, and its gradients.
 *
 * No matrix-multiply form exists for L1, so the work is O(m·n·d) elementwise. The scores
 * put the key index innermost, on a transposed block of keys held in L1 cache, so the
 * compiler vectorizes them across keys with no per-pair horizontal sum (torch.cdist
 * vectorizes across d and reduces every pair); the gradients vectorize across d with keys
 * held in registers (see l1_key_group). The gradient uses sign(0) = 0, as torch.cdist's does.
 *
 * Layout: batched row-major matrices, q (nb, m, d), k (nb, n, d), scores / ds (nb, m, n),
 * dq (nb, m, d), dk (nb, n, d). Scores and ds are contiguous; the others have contiguous
 * rows of d, each batch item `step` elements after the one before (a tile sliced out of a
 * (B, H, N, d) tensor is read and written in place). dq and dk are accumulated into (+=).
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 64

#define KEYS 16 /* key vectors the L1 gradient loop holds in registers at once */

/* -1, read at run time. x - y written as fma(y, -1, x) is the same number (the exact
 * difference, rounded once), but it runs on the multiply-add units instead of the adders,
 * which the score sum keeps busy: L1 scores take 0.84x the time they take with a
 * subtraction (docs/performance.md, "CPU: inner loops"). A constant -1 would be folded back
 * into a subtraction. */
static volatile double minus_one = -1.0;

/* The gradient loop's vectors are the target's widest: 64 bytes with AVX-512, 32 with AVX,
 * else 16 (SSE, NEON). Wider vectors are pairs of registers and the loop spills: with AVX2's
 * 16 registers 64-byte vectors take 9x the time, and at -march=x86-64-v2 32-byte ones 3.5x
 * (docs/performance.md, "CPU: inner loops"). */
#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
int64_t l1_vector_bytes(void) { return VBYTES; }

/* g carrying the sign of diff, 0 where diff is 0 (g sign(diff) with sign(0) = 0), lane-wise
 * on vectors of a float type and its same-size integer. With AVX-512 it is sign(diff) from
 * one fixup-by-class operation (a table of -1, +0, +1 by diff's class) times g, which the
 * compiler fuses into the sums' additions as multiply-adds: the L1 gradient loop is bound by
 * its count of vector operations, four a pair of vectors this way where a compare and a
 * masked ternary logic g ^ (diff & sign bit) make five (0.85-0.87x the time:
 * docs/performance.md, "CPU: inner loops"). sign(diff) times g is exact, so the sums are
 * the same bit for bit, but for an infinite g at a tie (NaN, not 0, as the AVX2 form's). */
typedef float vf32 __attribute__((vector_size(VBYTES)));
typedef int32_t vi32 __attribute__((vector_size(VBYTES)));
typedef double vf64 __attribute__((vector_size(VBYTES)));
typedef int64_t vi64 __attribute__((vector_size(VBYTES)));
#if defined(__AVX512F__)
#include <immintrin.h>
/* vfixupimm's table, 4 bits a class from the lowest: QNaN, SNaN, zero, +1, -inf, +inf,
 * negative, positive; 8 is +0, 9 is -1, 10 is +1. */
#define SIGN_BY_CLASS 0xA9A9A888
static inline vf32 signed_g_f32(vi32 g, vf32 diff, vi32 sign) {
    (void)sign;
    return (vf32)_mm512_fixupimm_ps((__m512)diff, (__m512)diff,
                                    _mm512_set1_epi32(SIGN_BY_CLASS), 0) * (vf32)g;
}
static inline vf64 signed_g_f64(vi64 g, vf64 diff, vi64 sign) {
    (void)sign;
    return (vf64)_mm512_fixupimm_pd((__m512d)diff, (__m512d)diff,
                                    _mm512_set1_epi64(SIGN_BY_CLASS), 0) * (vf64)g;
}
#else
#if defined(__AVX2__) && VBYTES == 32
#include <immintrin.h>
/* With AVX2 in float: 2 sign(diff) as a float straight from vpsignd (which reads diff's bits
 * as an int32: negative exactly where its sign bit is set, 0 only for +0) on 2.0's bits, since
 * the integer negation of 2.0's bits is -2.0's, times g; the sums are halved where they are
 * stored (L1_HALF). Two operations for four: 0.94-0.95x the time of vpsignd of the integer
 * ±1 and a convert (docs/performance.md, "CPU: inner loops"). The
 * result is bit for bit the same but for a halved sum in the subnormal range, an infinite g
 * at a tie (NaN, not 0) and |g| over half the float range (inf). q - k is never -0 here: the
 * loop adds 0 to q and k first. */
#define L1_HALF_f32 0.5f
static inline vf32 signed_g_f32(vi32 g, vf32 diff, vi32 sign) {
    (void)sign;
    return (vf32)_mm256_sign_epi32(_mm256_set1_epi32(0x40000000), (__m256i)diff) * (vf32)g;
}
#else
static inline vf32 signed_g_f32(vi32 g, vf32 diff, vi32 sign) {
    return (vf32)((g ^ ((vi32)diff & sign)) & (vi32)(diff != 0));
}
#endif
static inline vf64 signed_g_f64(vi64 g, vf64 diff, vi64 sign) {
    return (vf64)((g ^ ((vi64)diff & sign)) & (vi64)(diff != 0));
}
#endif
#ifndef L1_HALF_f32
#define L1_HALF_f32 1.0f /* signed_g_f32 gives g sign(diff) itself */
#endif
#define L1_HALF_f64 1.0

/* Vectors of d per pass of the L1 gradient loop: in float with AVX2's 16 registers, two
 * vectors of 8 keys share each broadcast of ds and each pass over the queries, where one
 * vector of 16 keys broadcasts ds for every vector (0.93-0.95x the time: docs/performance.md,
 * "CPU: inner loops"). double takes 1.1x the time with two (its sign is four operations, not
 * two); AVX-512 keeps one. */
#if VBYTES == 32
#define L1_WIDTH_f32 2
#else
#define L1_WIDTH_f32 1
#endif
#define L1_WIDTH_f64 1
#define L1_MAX_WIDTH 2

#define DEFINE_L1(T, I, SUFFIX, ABS, FMA)                                                   \
static void transpose_block_##SUFFIX(const T *k, int64_t n0, int64_t cols, int64_t d,       \
                                     T *kt) {                                               \
    for (int64_t j = 0; j < cols; j++)                                                      \
        for (int64_t c = 0; c < d; c++)                                                     \
            kt[c * BLOCK + j] = k[(n0 + j) * d + c];                                        \
    for (int64_t c = 0; c < d; c++)                                                         \
        for (int64_t j = cols; j < BLOCK; j++)                                              \
            kt[c * BLOCK + j] = 0;                                                          \
}                                                                                           \
                                                                                            \
/* GCC's unroll-and-jam (on at -O3) jams two steps of the d loop into the key loop and     \
 * stores the key sums to memory every step: 1.55-1.90 ms with it against 1.31-1.37 ms     \
 * without on an 8 x 256 x 256 float tile (Zen 3, calls alternating). */                  \
_Pragma("GCC push_options")                                                                 \
_Pragma("GCC optimize(\"no-loop-unroll-and-jam\")")                                         \
void l1_scores_##SUFFIX(const T *q, const T *k, T *out, int64_t nb, int64_t m, int64_t n,   \
                        int64_t d, int64_t q_step, int64_t k_step, T *kt) {                 \
    const T neg = (T)minus_one;                                                             \
    for (int64_t b = 0; b < nb; b++) {                                                      \
        const T *qb = q + b * q_step, *kb = k + b * k_step;                                 \
        T *ob = out + b * m * n;                                                            \
        for (int64_t n0 = 0; n0 < n; n0 += BLOCK) {                                         \
            int64_t cols = n - n0 < BLOCK ? n - n0 : BLOCK;                                 \
            transpose_block_##SUFFIX(kb, n0, cols, d, kt);                                  \
            for (int64_t i = 0; i < m; i++) {                                               \
                T acc[BLOCK] = {0};                                                         \
                const T *qi = qb + i * d;                                                   \
                for (int64_t c = 0; c < d; c++) {                                           \
                    const T x = qi[c], *row = kt + c * BLOCK;                               \
                    _Pragma("omp simd")                                                     \
                    for (int64_t j = 0; j < BLOCK; j++) acc[j] += ABS(FMA(row[j], neg, x)); \
                }                                                                           \
                T *oi = ob + i * n + n0;                                                    \
                for (int64_t j = 0; j < cols; j++) oi[j] = -acc[j];                         \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
_Pragma("GCC pop_options")                                                                  \
                                                                                            \
/* One group of up to KEYS / width keys against every query, over width vectors of dims   \
 * from c0: the keys' dk sums stay in registers while the queries stream past, so every sum \
 * is lane-wise (no reduction across lanes), with one load and store of dq per query for    \
 * the group. Inlined with a constant width and keys = KEYS / width for whole groups, so   \
 * they have no per-key branch. Each query's sum alternates between two registers: one     \
 * chain of dependent additions per query would bound the loop. */                         \
static inline __attribute__((always_inline)) void l1_key_group_##SUFFIX(                    \
        const T *sb, const T *qb, const T *kb, T *dqb, T *dkb, int64_t m, int64_t n,        \
        int64_t d, int64_t c0, int64_t keys, const int width) {                             \
    typedef T vec __attribute__((vector_size(VBYTES)));                                     \
    typedef I ivec __attribute__((vector_size(VBYTES)));                                    \
    const ivec sign = (ivec){0} + ((I)1 << (8 * sizeof(I) - 1));                            \
    const int64_t lanes = VBYTES / sizeof(T), group = KEYS / width;                         \
    const T half = L1_HALF_##SUFFIX;                                                        \
    vec kc[KEYS], acc[KEYS], v;                                                             \
    for (int64_t u = 0; u < group; u++)                                                     \
        for (int w = 0; w < width; w++) {                                                   \
            kc[u * width + w] = acc[u * width + w] = (vec){0};                              \
            if (u < keys) memcpy(&kc[u * width + w], kb + u * d + c0 + w * lanes, sizeof(vec)); \
            kc[u * width + w] += 0; /* -0 -> +0, for signed_g: then q - k is -0 nowhere */  \
        }                                                                                   \
    for (int64_t i = 0; i < m; i++) {                                                       \
        const T *gi = sb + i * n;                                                           \
        vec qv[L1_MAX_WIDTH], even[L1_MAX_WIDTH], odd[L1_MAX_WIDTH];                        \
        for (int w = 0; w < width; w++) {                                                   \
            memcpy(&qv[w], qb + i * d + c0 + w * lanes, sizeof(vec));                       \
            qv[w] += 0;                                                                     \
            even[w] = odd[w] = (vec){0};                                                    \
        }                                                                                   \
        for (int64_t u = 0; u < group; u++) {                                               \
            /* -0 + g is g, so no addition is left: a broadcast */                          \
            const ivec g = (ivec)(-(vec){0} + (u < keys ? gi[u] : 0));                      \
            for (int w = 0; w < width; w++) {                                               \
                const vec t = signed_g_##SUFFIX(g, qv[w] - kc[u * width + w], sign);        \
                if (u & 1) odd[w] += t; else even[w] += t;                                  \
                acc[u * width + w] += t;                                                    \
            }                                                                               \
        }                                                                                   \
        for (int w = 0; w < width; w++) {                                                   \
            memcpy(&v, dqb + i * d + c0 + w * lanes, sizeof(vec));                          \
            v -= (even[w] + odd[w]) * half;                                                 \
            memcpy(dqb + i * d + c0 + w * lanes, &v, sizeof(vec));                          \
        }                                                                                   \
    }                                                                                       \
    for (int64_t u = 0; u < keys; u++)                                                      \
        for (int w = 0; w < width; w++) {                                                   \
            memcpy(&v, dkb + u * d + c0 + w * lanes, sizeof(vec));                          \
            v += acc[u * width + w] * half;                                                 \
            memcpy(dkb + u * d + c0 + w * lanes, &v, sizeof(vec));                          \
        }                                                                                   \
}                                                                                           \
                                                                                            \
/* The groups of keys over the vectors of d from c0, width at a time. */                    \
static inline __attribute__((always_inline)) void l1_key_groups_##SUFFIX(                   \
        const T *sb, const T *qb, const T *kb, T *dqb, T *dkb, int64_t m, int64_t n,        \
        int64_t d, int64_t c0, const int width) {                                           \
    const int64_t group = KEYS / width;                                                     \
    int64_t j0 = 0;                                                                         \
    for (; j0 + group <= n; j0 += group)                                                    \
        l1_key_group_##SUFFIX(sb + j0, qb, kb + j0 * d, dqb, dkb + j0 * d, m, n, d, c0,     \
                              group, width);                                                \
    if (j0 < n)                                                                             \
        l1_key_group_##SUFFIX(sb + j0, qb, kb + j0 * d, dqb, dkb + j0 * d, m, n, d, c0,     \
                              n - j0, width);                                               \
}                                                                                           \
                                                                                            \
void l1_grads_##SUFFIX(const T *ds, const T *q, const T *k, T *dq, T *dk, int64_t nb,       \
                       int64_t m, int64_t n, int64_t d, int64_t q_step, int64_t k_step,     \
                       int64_t dq_step, int64_t dk_step) {                                  \
    /* d: a multiple of a vector (VBYTES, l1_vector_bytes). Written with vector types: the  \
     * loop vectorizer unrolls such short fixed loops first and then leaves them scalar. */ \
    const int64_t lanes = VBYTES / sizeof(T);                                               \
    for (int64_t b = 0; b < nb; b++) {                                                      \
        const T *qb = q + b * q_step, *kb = k + b * k_step, *sb = ds + b * m * n;           \
        T *dqb = dq + b * dq_step, *dkb = dk + b * dk_step;                                 \
        int64_t c0 = 0;                                                                     \
        for (; c0 + L1_WIDTH_##SUFFIX * lanes <= d; c0 += L1_WIDTH_##SUFFIX * lanes)        \
            l1_key_groups_##SUFFIX(sb, qb, kb, dqb, dkb, m, n, d, c0, L1_WIDTH_##SUFFIX);   \
        for (; c0 < d; c0 += lanes)                                                         \
            l1_key_groups_##SUFFIX(sb, qb, kb, dqb, dkb, m, n, d, c0, 1);                   \
    }                                                                                       \
}

DEFINE_L1(float, int32_t, f32, __builtin_fabsf, __builtin_fmaf)
DEFINE_L1(double, int64_t, f64, __builtin_fabs, __builtin_fma)

/* One step of the online softmax over a tile of scores s (rows, cols), in place.
 *
 * For each row: new_max = max(row_max, max(s)); s <- exp(s - m) with m = new_max, or 0 while
 * the row has seen no allowed key (new_max = -inf, so masked -inf scores give exactly 0);
 * correction = exp(row_max - m); row_sum <- row_sum * correction + sum(s); the row's output
 * accumulator acc (rows, dv) <- acc * correction; row_max <- new_max.
 * Two passes over each row (the row stays in L1 cache) instead of one pass over the whole
 * tile per operation.
 */
static inline double exp_nonpositive_f64(double x) { return __builtin_exp(x); }

/* An optional mask of allowed (1) / forbidden (0) pairs, one byte each, laid out as
 * (Bm, Hm, bq, cols) with Bm in {1, B} and Hm in {1, H}: score row r = (b, h, i) of a tile
 * (B, H, bq, cols) reads mask row b * sb + h * sh + i * cols (sb, sh are 0 when broadcast).
 * A forbidden pair counts as a score of -inf whatever the score holds (even NaN). */
static inline const uint8_t *mask_row(const uint8_t *mask, int64_t r, int64_t heads,
                                      int64_t bq, int64_t sb, int64_t sh, int64_t cols) {
    if (!mask) return 0;
    return mask + (r / (heads * bq)) * sb + ((r / bq) % heads) * sh + (r % bq) * cols;
}

/* The largest of m and a row's scores, a forbidden score counting as `fill`: the online
 * steps' running max (softmax's, fill -inf; softpick's in cpu_weights.c, fill 0). Masked and
 * unmasked rows loop apart: a test of the mask pointer inside the loop keeps it from
 * vectorizing. */
#define DEFINE_ROW_MAX(T, SUFFIX)                                                           \
static inline T row_max_##SUFFIX(const T *row, const uint8_t *allowed, int64_t cols, T m,   \
                                 T fill) {                                                  \
    if (allowed) {                                                                          \
        _Pragma("omp simd reduction(max:m)")                                                \
        for (int64_t j = 0; j < cols; j++) {                                                \
            const T x = allowed[j] ? row[j] : fill;                                         \
            m = x > m ? x : m;                                                              \
        }                                                                                   \
    } else {                                                                                \
        _Pragma("omp simd reduction(max:m)")                                                \
        for (int64_t j = 0; j < cols; j++) m = row[j] > m ? row[j] : m;                     \
    }                                                                                       \
    return m;                                                                               \
}
DEFINE_ROW_MAX(float, f32)
DEFINE_ROW_MAX(double, f64)

#define DEFINE_SOFTMAX(T, SUFFIX)                                                           \
void online_softmax_step_##SUFFIX(T *s, int64_t rows, int64_t cols, T *row_max,            \
                                  T *row_sum, T *acc, int64_t dv, const uint8_t *mask,      \
                                  int64_t heads, int64_t bq, int64_t sb, int64_t sh) {      \
    const T neg_inf = -(T)__builtin_inf();                                                  \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        T *row = s + r * cols, m = row_max[r], sum = 0;                                     \
        const uint8_t *allowed = mask_row(mask, r, heads, bq, sb, sh, cols);                \
        m = row_max_##SUFFIX(row, allowed, cols, m, neg_inf);                               \
        const T safe = m == neg_inf ? 0 : m;                                                \
        if (allowed) {                                                                      \
            _Pragma("omp simd reduction(+:sum)")                                            \
            for (int64_t j = 0; j < cols; j++) {                                            \
                T p = allowed[j] ? exp_nonpositive_##SUFFIX(row[j] - safe) : 0;             \
                row[j] = p;                                                                 \
                sum += p;                                                                   \
            }                                                                               \
        } else {                                                                            \
            _Pragma("omp simd reduction(+:sum)")                                            \
            for (int64_t j = 0; j < cols; j++) {                                            \
                T p = exp_nonpositive_##SUFFIX(row[j] - safe);                              \
                row[j] = p;                                                                 \
                sum += p;                                                                   \
            }                                                                               \
        }                                                                                   \
        const T c = exp_nonpositive_##SUFFIX(row_max[r] - safe);                            \
        T *out = acc + r * dv;                                                              \
        for (int64_t j = 0; j < dv; j++) out[j] *= c;                                       \
        row_sum[r] = row_sum[r] * c + sum;                                                  \
        row_max[r] = m;                                                                     \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void exp_sub_rows_##SUFFIX(T *s, int64_t rows, int64_t cols, const T *lse,                  \
                           const uint8_t *mask, int64_t heads, int64_t bq, int64_t sb,      \
                           int64_t sh) {                                                    \
    /* s <- exp(s - lse[row]), 0 where the mask forbids; lse = +inf (a row with no allowed  \
     * key) gives 0. */                                                                     \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        T *row = s + r * cols;                                                              \
        const T l = lse[r];                                                                 \
        const uint8_t *allowed = mask_row(mask, r, heads, bq, sb, sh, cols);                \
        _Pragma("omp simd")                                                                 \
        for (int64_t j = 0; j < cols; j++) {                                                \
            T x = row[j] - l;                                                               \
            T p = exp_nonpositive_##SUFFIX(x != x ? -(T)__builtin_inf() : x);               \
            row[j] = (!allowed || allowed[j]) ? p : 0;                                      \
        }                                                                                   \
    }                                                                                       \
}

#define DEFINE_SOFTMAX_GRAD(T, SUFFIX)                                                      \
void softmax_grad_rows_##SUFFIX(const T *p, T *dp, int64_t rows, int64_t cols,              \
                                const T *delta, const T *slope, double scale_) {            \
    /* dp <- p * (dp - delta[row]): d(loss)/d(scores) of a softmax tile. With a slope (a    \
     * score modifier's derivative, from the generated mod_scores_ds), times slope * scale  \
     * where that is not 0 (never 0 * inf), in this pass rather than one more over the      \
     * tile. */                                                                             \
    const T scale = (T)scale_;                                                              \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        const T *pr = p + r * cols, d = delta[r];                                           \
        T *g = dp + r * cols;                                                               \
        if (slope == 0) {                                                                   \
            _Pragma("omp simd")                                                             \
            for (int64_t j = 0; j < cols; j++) g[j] = pr[j] * (g[j] - d);                   \
            continue;                                                                       \
        }                                                                                   \
        const T *sr = slope + r * cols;                                                     \
        _Pragma("omp simd")                                                                 \
        for (int64_t j = 0; j < cols; j++) {                                                \
            const T v = pr[j] * (g[j] - d);                                                 \
            g[j] = v != 0 ? v * sr[j] * scale : 0;                                          \
        }                                                                                   \
    }                                                                                       \
}

DEFINE_SOFTMAX_GRAD(float, f32)
DEFINE_SOFTMAX_GRAD(double, f64)
DEFINE_SOFTMAX(float, f32)
DEFINE_SOFTMAX(double, f64)

/* Graph attention along edges, without gathering features per edge. Rows are laid out
 * (B, N, heads, d) contiguous: q and the target side (Nq, H heads), k and v the source side
 * (Nk, Hk heads; query head h reads key head h / (H / Hk)). Edge e joins target[e] (a query)
 * and source[e] (a key); per-edge values are (B, E, H). kernel: the term's kind
 * (engines/lowering.py TermKind, by name from the compile flags): QKV_TERM_DOT q.k,
 * QKV_TERM_SQDIST -|q-k|^2, QKV_TERM_L1 -|q-k|_1; any other is rejected, never defaulted.
 */
static inline int known_kernel(int64_t kernel) {
    return kernel == QKV_TERM_DOT || kernel == QKV_TERM_SQDIST || kernel == QKV_TERM_L1;
}

#define DEFINE_EDGES(T, SUFFIX, ABS)                                                        \
static inline T pair_kernel_##SUFFIX(int kernel, const T *a, const T *b, int64_t d) {       \
    T total = 0;                                                                            \
    if (kernel == QKV_TERM_DOT) {                                                           \
        _Pragma("omp simd reduction(+:total)")                                              \
        for (int64_t c = 0; c < d; c++) total += a[c] * b[c];                               \
        return total;                                                                       \
    }                                                                                       \
    if (kernel == QKV_TERM_SQDIST) {                                                        \
        _Pragma("omp simd reduction(+:total)")                                              \
        for (int64_t c = 0; c < d; c++) total += (a[c] - b[c]) * (a[c] - b[c]);             \
        return -total;                                                                      \
    }                                                                                       \
    /* QKV_TERM_L1: the callers have checked the kind (known_kernel) */                     \
    _Pragma("omp simd reduction(+:total)")                                                  \
    for (int64_t c = 0; c < d; c++) total += ABS(a[c] - b[c]);                              \
    return -total;                                                                          \
}                                                                                           \
                                                                                            \
int64_t edge_scores_##SUFFIX(int64_t kernel, const T *q, const T *k, const int64_t *target,    \
                          const int64_t *source, T *out, int64_t batch, int64_t edges,      \
                          int64_t nq, int64_t nk, int64_t heads, int64_t kv_heads,          \
                          int64_t d) {                                                      \
    /* out[b, e, h] = kernel(q[b, target[e], h], k[b, source[e], h / group]); returns -1,  \
     * computing nothing, for a kernel id it does not know. */                              \
    if (!known_kernel(kernel)) return -1;                                                   \
    const int64_t group = heads / kv_heads;                                                 \
    for (int64_t b = 0; b < batch; b++)                                                     \
        for (int64_t e = 0; e < edges; e++) {                                               \
            const T *qe = q + ((b * nq + target[e]) * heads) * d;                           \
            const T *ke = k + ((b * nk + source[e]) * kv_heads) * d;                        \
            T *oe = out + (b * edges + e) * heads;                                          \
            for (int64_t h = 0; h < heads; h++)                                             \
                oe[h] = pair_kernel_##SUFFIX((int)kernel, qe + h * d, ke + (h / group) * d, d);\
        }                                                                                   \
    return 0;                                                                               \
}                                                                                           \
                                                                                            \
void edge_scatter_##SUFFIX(const T *w, const T *x, const int64_t *from, const int64_t *to, \
                           T *out, int64_t batch, int64_t edges, int64_t n_from,            \
                           int64_t n_to, int64_t heads, int64_t x_heads, int64_t out_heads, \
                           int64_t d) {                                                     \
    /* out[b, to[e], h / (heads / out_heads)] += w[b, e, h] * x[b, from[e], h / (heads /    \
     * x_heads)]: the weighted sum of values into targets (from = source) and of output     \
     * gradients into sources (from = target). */                                          \
    const int64_t xg = heads / x_heads, og = heads / out_heads;                             \
    for (int64_t b = 0; b < batch; b++)                                                     \
        for (int64_t e = 0; e < edges; e++) {                                               \
            const T *xe = x + ((b * n_from + from[e]) * x_heads) * d;                       \
            T *oe = out + ((b * n_to + to[e]) * out_heads) * d;                             \
            const T *we = w + (b * edges + e) * heads;                                      \
            for (int64_t h = 0; h < heads; h++) {                                           \
                const T weight = we[h], *xr = xe + (h / xg) * d;                            \
                T *orow = oe + (h / og) * d;                                                \
                _Pragma("omp simd")                                                         \
                for (int64_t c = 0; c < d; c++) orow[c] += weight * xr[c];                  \
            }                                                                               \
        }                                                                                   \
}                                                                                           \
                                                                                            \
int64_t edge_kernel_grads_##SUFFIX(int64_t kernel, const T *ds, const T *q, const T *k,        \
                                const int64_t *target, const int64_t *source, T *dq, T *dk, \
                                int64_t batch, int64_t edges, int64_t nq, int64_t nk,       \
                                int64_t heads, int64_t kv_heads, int64_t d) {               \
    /* dq[target] += ds * d kernel / dq, dk[source] += ds * d kernel / dk. dot: k and q;    \
     * -|q-k|^2: -2(q-k) and 2(q-k); -|q-k|_1: -sign(q-k) and sign(q-k), sign(0) = 0.      \
     * Returns -1, computing nothing, for a kernel id it does not know. */                  \
    if (!known_kernel(kernel)) return -1;                                                   \
    const int64_t group = heads / kv_heads;                                                 \
    for (int64_t b = 0; b < batch; b++)                                                     \
        for (int64_t e = 0; e < edges; e++) {                                               \
            const int64_t qi = (b * nq + target[e]) * heads, ki = (b * nk + source[e]) * kv_heads;\
            for (int64_t h = 0; h < heads; h++) {                                           \
                const T g = ds[(b * edges + e) * heads + h];                                \
                const T *qr = q + (qi + h) * d, *kr = k + (ki + h / group) * d;             \
                T *dqr = dq + (qi + h) * d, *dkr = dk + (ki + h / group) * d;               \
                if (kernel == QKV_TERM_DOT) {                                               \
                    _Pragma("omp simd")                                                     \
                    for (int64_t c = 0; c < d; c++) {                                       \
                        dqr[c] += g * kr[c];                                                \
                        dkr[c] += g * qr[c];                                                \
                    }                                                                       \
                } else if (kernel == QKV_TERM_SQDIST) {                                     \
                    _Pragma("omp simd")                                                     \
                    for (int64_t c = 0; c < d; c++) {                                       \
                        T t = 2 * g * (qr[c] - kr[c]);                                      \
                        dqr[c] -= t;                                                        \
                        dkr[c] += t;                                                        \
                    }                                                                       \
                } else { /* QKV_TERM_L1, checked above */                                   \
                    _Pragma("omp simd")                                                     \
                    for (int64_t c = 0; c < d; c++) {                                       \
                        T diff = qr[c] - kr[c];                                             \
                        T t = g * (T)((diff > 0) - (diff < 0));                             \
                        dqr[c] -= t;                                                        \
                        dkr[c] += t;                                                        \
                    }                                                                       \
                }                                                                           \
            }                                                                               \
        }                                                                                   \
    return 0;                                                                               \
}

DEFINE_EDGES(float, f32, __builtin_fabsf)
DEFINE_EDGES(double, f64, __builtin_fabs)
