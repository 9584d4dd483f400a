/* The weightings' steps on one head's tile (core/weighting/; engines/lowering.py
 * WeightsKind): zeroing masked weights, softpick's online step, weights and gradient, and
 * stick-breaking's shares, weights and gradient. Compiled after cpu_kernels.c (its
 * exp_nonpositive) and before cpu_blocks.c, which calls them, in the same library. */
#include <math.h>
#include <stdint.h>

/* e^x - 1 for |x| < 1/2, where exp(x) - 1 would cancel: for float32 a degree-8 Taylor
 * polynomial (relative error below 1e-7), which vectorizes; float64 keeps libm's. Beyond
 * 1/2, exp(x) - 1 loses no digits, and the callers take it. */
static inline float expm1_small_f32(float x) {
    return x * (1.0f + x * (0.5f + x * (1.0f / 6 + x * (1.0f / 24 + x * (
        1.0f / 120 + x * (1.0f / 720 + x * (1.0f / 5040 + x * (1.0f / 40320))))))));
}
static inline double expm1_small_f64(double x) { return expm1(x); }

/* The weightings' steps on one head's tile of rows x cols (row-major), its mask rows `mask`
 * (bytes, rows x cols) or 0. A forbidden pair has weight 0 whatever its score holds. The
 * loops over a row vectorize: exp through exp_nonpositive (inverted for x > 0). */
#define DEFINE_WEIGHTS(T, SUFFIX)                                                           \
static inline T exp_any_##SUFFIX(T x) {                                                     \
    const T e = exp_nonpositive_##SUFFIX(x > 0 ? -x : x);                                   \
    return x > 0 ? 1 / e : e;                                                               \
}                                                                                           \
static inline void zero_masked_##SUFFIX(T *s, int64_t rows, int64_t cols,                   \
                                        const uint8_t *mask) {                              \
    if (!mask) return;                                                                      \
    _Pragma("omp simd")                                                                     \
    for (int64_t e = 0; e < rows * cols; e++) {                                             \
        const T v = s[e];                                                                   \
        s[e] = mask[e] ? v : 0;                                                             \
    }                                                                                       \
}                                                                                           \
/* dp <- dp * slope * scale (0 where masked, never 0 * inf): d(loss)/d(raw score) from      \
 * d(loss)/d(modified score), slope the modifier's derivative (0: slope 1). */              \
static inline void weight_grad_##SUFFIX(T *dp, int64_t rows, int64_t cols, const T *slope,  \
                                        double scale_, const uint8_t *mask) {               \
    const T scale = (T)scale_;                                                              \
    zero_masked_##SUFFIX(dp, rows, cols, mask);                                             \
    if (slope == 0) return;                                                                 \
    _Pragma("omp simd")                                                                     \
    for (int64_t e = 0; e < rows * cols; e++) {                                             \
        const T g = dp[e], v = g * slope[e] * scale;                                        \
        dp[e] = g != 0 ? v : 0;                                                             \
    }                                                                                       \
}                                                                                           \
static inline T softpick_d_##SUFFIX(T x, T m, T em) {                                      \
    return (x > -(T)0.5 && x < (T)0.5) ? expm1_small_##SUFFIX(x) * em                       \
                                       : exp_nonpositive_##SUFFIX(x - m) - em;              \
}                                                                                           \
/* Softpick's online step: the max (>= 0) and the sum of |d|, d = e^(x-m) - e^(-m) =        \
 * e^(-m) (e^x - 1) (expm1 keeps the digits near x = 0), updated; s replaced by relu(d);    \
 * acc (rows x dv) rescaled to the new max. */                                              \
static inline void softpick_step_##SUFFIX(T *s, int64_t rows, int64_t cols, T *row_max,     \
                                          T *row_sum, T *acc, int64_t dv,                   \
                                          const uint8_t *mask) {                            \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        T *row = s + r * cols, m = row_max[r], sum = 0;                                     \
        const uint8_t *allowed = mask ? mask + r * cols : 0;                                \
        m = row_max_##SUFFIX(row, allowed, cols, m, 0);                                     \
        const T em = exp_nonpositive_##SUFFIX(-m);                                          \
        if (allowed) {                                                                      \
            _Pragma("omp simd reduction(+:sum)")                                            \
            for (int64_t j = 0; j < cols; j++) {                                            \
                const T x = row[j], d0 = softpick_d_##SUFFIX(x, m, em), d = allowed[j] ? d0 : 0; \
                row[j] = d > 0 ? d : 0;                                                     \
                sum += d > 0 ? d : -d;                                                      \
            }                                                                               \
        } else {                                                                            \
            _Pragma("omp simd reduction(+:sum)")                                            \
            for (int64_t j = 0; j < cols; j++) {                                            \
                const T d = softpick_d_##SUFFIX(row[j], m, em);                             \
                row[j] = d > 0 ? d : 0;                                                     \
                sum += d > 0 ? d : -d;                                                      \
            }                                                                               \
        }                                                                                   \
        const T c = exp_nonpositive_##SUFFIX(row_max[r] - m);                               \
        for (int64_t j = 0; j < dv; j++) acc[r * dv + j] *= c;                              \
        row_sum[r] = row_sum[r] * c + sum;                                                  \
        row_max[r] = m;                                                                     \
    }                                                                                       \
}                                                                                           \
/* Softpick's weights from the saved log Z: e^-lz (e^x - 1) for x > 0, else 0. */          \
static inline void softpick_weights_##SUFFIX(const T *sc, T *w, int64_t rows, int64_t cols, \
                                             const T *lz, const uint8_t *mask) {            \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        const T l = lz[r], el = exp_any_##SUFFIX(-l);                                       \
        _Pragma("omp simd")                                                                 \
        for (int64_t j = 0; j < cols; j++) {                                                \
            const int64_t e = r * cols + j;                                                 \
            const T x = sc[e], v = x < (T)0.5 ? expm1_small_##SUFFIX(x) * el                \
                : exp_any_##SUFFIX(x - l) - el;                                             \
            w[e] = x > 0 ? v : 0;                                                           \
        }                                                                                   \
    }                                                                                       \
    zero_masked_##SUFFIX(w, rows, cols, mask);                                              \
}                                                                                           \
/* dp <- e^(x - lz) ([x > 0] dp - sign(x) delta): softpick's d(loss)/d(score). */           \
static inline void softpick_grad_##SUFFIX(const T *sc, T *dp, int64_t rows, int64_t cols,   \
                                          const T *lz, const T *delta,                      \
                                          const uint8_t *mask) {                            \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        const T l = lz[r], d = delta[r];                                                    \
        _Pragma("omp simd")                                                                 \
        for (int64_t j = 0; j < cols; j++) {                                                \
            const int64_t e = r * cols + j;                                                 \
            const T x = sc[e], p = dp[e], g = x > 0 ? p - d : (x < 0 ? d : 0);              \
            dp[e] = exp_any_##SUFFIX(x - l) * g;                                            \
        }                                                                                   \
    }                                                                                       \
    zero_masked_##SUFFIX(dp, rows, cols, mask);                                             \
}                                                                                           \
/* beta = sigma(x) and rest = 1 - beta = sigma(-x) of one row, each from e = e^-|x| without \
 * cancellation; keys not taken get beta 0 and rest 1. */                                   \
static inline void stick_shares_##SUFFIX(const T *x, T *beta, T *rest, int64_t cols,         \
                                         const uint8_t *allowed, int64_t taken) {           \
    _Pragma("omp simd")                                                                     \
    for (int64_t j = 0; j < taken; j++) {                                                   \
        const T v = x[j], e = exp_nonpositive_##SUFFIX(v > 0 ? -v : v), inv = 1 / (1 + e);  \
        beta[j] = v >= 0 ? inv : e * inv;                                                   \
        rest[j] = v >= 0 ? e * inv : inv;                                                   \
    }                                                                                       \
    for (int64_t j = taken; j < cols; j++) beta[j] = 0;                                     \
    if (allowed) {                                                                          \
        _Pragma("omp simd")                                                                 \
        for (int64_t j = 0; j < taken; j++) {                                               \
            const T b = beta[j], r = rest[j];                                               \
            beta[j] = allowed[j] ? b : 0;                                                   \
            rest[j] = allowed[j] ? r : 1;                                                   \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
/* Stick-breaking's weights of one tile: w = beta times the stick the later keys left,      \
 * carried as a product in left[r] (keys from the last to the first). Keys at or after the  \
 * query's position (after it with include_self) take no share. tmp: a row of cols. */      \
static inline void stick_weights_##SUFFIX(const T *sc, T *w, int64_t rows, int64_t cols,    \
                                          T *left, const uint8_t *mask, int64_t first_pos,  \
                                          int64_t k0, int64_t include_self, T *tmp) {       \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        int64_t taken = first_pos + r + (include_self ? 1 : 0) - k0;                        \
        taken = taken < 0 ? 0 : (taken > cols ? cols : taken);                              \
        stick_shares_##SUFFIX(sc + r * cols, w + r * cols, tmp, cols,                       \
                              mask ? mask + r * cols : 0, taken);                           \
        T stick = left[r], *wr = w + r * cols;                                              \
        for (int64_t j = taken - 1; j >= 0; j--) {                                          \
            wr[j] *= stick;                                                                 \
            stick *= tmp[j];                                                                \
        }                                                                                   \
        left[r] = stick;                                                                    \
    }                                                                                       \
}                                                                                           \
/* dp <- g - beta (delta - later), g = dp w, keys from the last to the first, later the     \
 * sum of g over the keys after (carried in later[r]): stick-breaking's d(loss)/d(score).   \
 * tmp: two rows of cols. */                                                               \
static inline void stick_grad_##SUFFIX(const T *sc, const T *w, T *dp, int64_t rows,        \
                                       int64_t cols, const T *delta, T *later,              \
                                       const uint8_t *mask, int64_t first_pos, int64_t k0,  \
                                       int64_t include_self, T *tmp) {                      \
    for (int64_t r = 0; r < rows; r++) {                                                    \
        int64_t taken = first_pos + r + (include_self ? 1 : 0) - k0;                        \
        taken = taken < 0 ? 0 : (taken > cols ? cols : taken);                              \
        stick_shares_##SUFFIX(sc + r * cols, tmp, tmp + cols, cols, mask ? mask + r * cols : 0,  \
                              taken);                                                       \
        T after = later[r], *g = dp + r * cols;                                             \
        const T *wr = w + r * cols, d = delta[r];                                           \
        for (int64_t j = cols - 1; j >= taken; j--) g[j] = 0;                               \
        for (int64_t j = taken - 1; j >= 0; j--) {                                          \
            const T gj = g[j] * wr[j];                                                      \
            g[j] = gj - tmp[j] * (d - after);                                               \
            after += gj;                                                                    \
        }                                                                                   \
        later[r] = after;                                                                   \
    }                                                                                       \
}
DEFINE_WEIGHTS(float, f32)
DEFINE_WEIGHTS(double, f64)
