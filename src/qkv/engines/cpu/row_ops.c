/* RMSNorm and the rotary rotation of a few rows, each in one call: decoding's small
 * operations between its products.
 *
 * A decoded token of a LLaMA-shaped model runs two RMSNorms and two rotations a layer on one
 * row each. In torch an RMSNorm on the CPU is seven operations (pow, mean, add, rsqrt and
 * three products) and the rotation of q or k nine, each a few hundred floats of work, so a
 * token spends its time in their dispatch; the weights a token streams between them also
 * evict torch's code from the caches, which makes each of them 2-6x slower than in a loop
 * (docs/performance.md, "Generation"). Here each is one loop over its rows.
 *
 * Each row is computed from its own input alone, in a fixed order: a row's result is the same
 * in any batch. The sums of squares go in vector lanes, then in order. */
#include <math.h>
#include <stdint.h>

/* out (outer, inner, d) contiguous = x * weight / sqrt(mean(x²) + eps) over each row of d,
 * x's rows at x + o * s_outer + i * s_inner (unit stride along d). The scale multiplies x
 * first, then the weight, as torch's rms_norm does. */
void qkv_rms_norm_rows(const float *x, int64_t outer, int64_t inner, int64_t s_outer,
                       int64_t s_inner, const float *weight, float eps, float *out,
                       int64_t d) {
    for (int64_t o = 0; o < outer; o++)
        for (int64_t i = 0; i < inner; i++) {
            const float *row = x + o * s_outer + i * s_inner;
            float *dst = out + (o * inner + i) * d;
            float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
            for (int64_t j = 0; j < d; j++)
                squares += row[j] * row[j];
            float scale = 1.0f / sqrtf(squares / (float)d + eps);
#pragma omp simd
            for (int64_t j = 0; j < d; j++)
                dst[j] = row[j] * scale * weight[j];
        }
}

/* out (b, h, n, d) contiguous = x · cos + swap_halves(x) · sin, RoPE's rotation of pairs
 * (x[i], x[i + d/2]), with x (b, h, n, d) at strides (sb, sh, sn, 1) and cos, sin rows
 * (cos θ for both halves; -sin θ, sin θ) at cos + batch * cb + position * cn (cb = 0: the
 * same positions for every batch row), as qkv.nn.positions.Rotation holds them. */
void qkv_rotate_rows(const float *x, int64_t sb, int64_t sh, int64_t sn, const float *cos,
                     const float *sin, int64_t cb, int64_t cn, float *out, int64_t b,
                     int64_t h, int64_t n, int64_t d) {
    int64_t half = d / 2;
    for (int64_t bi = 0; bi < b; bi++)
        for (int64_t hi = 0; hi < h; hi++)
            for (int64_t ni = 0; ni < n; ni++) {
                const float *row = x + bi * sb + hi * sh + ni * sn;
                const float *c = cos + bi * cb + ni * cn, *s = sin + bi * cb + ni * cn;
                float *dst = out + ((bi * h + hi) * n + ni) * d;
#pragma omp simd
                for (int64_t j = 0; j < half; j++) {
                    dst[j] = row[j] * c[j] + row[j + half] * s[j];
                    dst[j + half] = row[j + half] * c[j + half] + row[j] * s[j + half];
                }
            }
}
