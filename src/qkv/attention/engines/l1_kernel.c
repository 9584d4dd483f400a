/* The negative L1 kernel -sum_d |q_d - k_d| on CPU tiles, and its gradients.
 *
 * No matrix-multiply form exists for L1, so the work is O(m·n·d) elementwise. These loops
 * put the key index innermost, on a transposed block of keys held in L1 cache, so the
 * compiler vectorizes them across keys with no per-pair horizontal sum (torch.cdist
 * vectorizes across d and reduces every pair). The gradient uses sign(0) = 0, as
 * torch.cdist's does.
 *
 * Layout: batched row-major matrices, q (nb, m, d), k (nb, n, d), scores / ds (nb, m, n),
 * dq (nb, m, d), dk (nb, n, d), all contiguous. dq and dk are accumulated into (+=).
 */
#include <stdint.h>
#include <string.h>

#define BLOCK 64

#define DEFINE_L1(T, SUFFIX, ABS)                                                           \
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
void l1_scores_##SUFFIX(const T *q, const T *k, T *out, int64_t nb, int64_t m, int64_t n,   \
                        int64_t d, T *kt) {                                                 \
    for (int64_t b = 0; b < nb; b++) {                                                      \
        const T *qb = q + b * m * d, *kb = k + b * n * d;                                   \
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
                    for (int64_t j = 0; j < BLOCK; j++) acc[j] += ABS(x - row[j]);          \
                }                                                                           \
                T *oi = ob + i * n + n0;                                                    \
                for (int64_t j = 0; j < cols; j++) oi[j] = -acc[j];                         \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
}                                                                                           \
                                                                                            \
void l1_grads_##SUFFIX(const T *ds, const T *q, const T *k, T *dq, T *dk, int64_t nb,       \
                       int64_t m, int64_t n, int64_t d, T *kt, T *dkt) {                    \
    for (int64_t b = 0; b < nb; b++) {                                                      \
        const T *qb = q + b * m * d, *kb = k + b * n * d, *sb = ds + b * m * n;             \
        T *dqb = dq + b * m * d, *dkb = dk + b * n * d;                                     \
        for (int64_t n0 = 0; n0 < n; n0 += BLOCK) {                                         \
            int64_t cols = n - n0 < BLOCK ? n - n0 : BLOCK;                                 \
            transpose_block_##SUFFIX(kb, n0, cols, d, kt);                                  \
            memset(dkt, 0, sizeof(T) * BLOCK * d);                                          \
            for (int64_t i = 0; i < m; i++) {                                               \
                T g[BLOCK] = {0};                                                           \
                memcpy(g, sb + i * n + n0, sizeof(T) * cols);                               \
                const T *qi = qb + i * d;                                                   \
                T *dqi = dqb + i * d;                                                       \
                for (int64_t c = 0; c < d; c++) {                                           \
                    const T x = qi[c], *row = kt + c * BLOCK;                               \
                    T *drow = dkt + c * BLOCK, total = 0;                                   \
                    _Pragma("omp simd reduction(+:total)")                                  \
                    for (int64_t j = 0; j < BLOCK; j++) {                                   \
                        T diff = x - row[j];                                                \
                        T t = g[j] * (T)((diff > 0) - (diff < 0));                          \
                        total += t;                                                         \
                        drow[j] += t;                                                       \
                    }                                                                       \
                    dqi[c] -= total;                                                        \
                }                                                                           \
            }                                                                               \
            for (int64_t j = 0; j < cols; j++)                                              \
                for (int64_t c = 0; c < d; c++)                                             \
                    dkb[(n0 + j) * d + c] += dkt[c * BLOCK + j];                            \
        }                                                                                   \
    }                                                                                       \
}

DEFINE_L1(float, f32, __builtin_fabsf)
DEFINE_L1(double, f64, __builtin_fabs)
