/* exp(x) for x <= 0, vectorizable, shared by the fused engine's loops (cpu_kernels.c) and
 * the attention viewer's row summaries (qkv.viz.row_stats): the first source of both. */
#include <stdint.h>

/* The floors of exp_nonpositive_f32, as globals: with literal floors GCC evaluates the
 * reduction for the floor as constants and picks between those and the real values by three
 * blends after each step, instead of one vmaxps on the input. */
__attribute__((visibility("hidden"))) float exp_floor_log2 = -126.0f;
__attribute__((visibility("hidden"))) float exp_floor = -87.33654475f; /* -126 ln 2 */

static inline float exp_nonpositive_f32(float x) {
    /* exp(x) for x <= 0 (or -inf), vectorizable: x = n ln2 + t with n = round(x log2 e) and
     * t reduced with ln 2 split in two parts (Cody-Waite, so t is exact to float rounding),
     * then 2^n * e^t with a degree-6 Taylor polynomial on |t| <= ln2/2 (relative error about
     * 2e-7). Below 2^-126 the result is 0: denormals are not produced. The floors are
     * written floor > v ? floor : v, vmaxps's order, so NaN passes. */
    const float floor_log2 = exp_floor_log2, floor = exp_floor;
    float y = x * 1.44269504088896341f;
    float below = y < floor_log2 ? 1.0f : 0.0f;
    y = floor_log2 > y ? floor_log2 : y;
    x = floor > x ? floor : x; /* where y was clamped */
    float n = (y + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    float t = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
    float p = 1.0f + t * (1.0f + t * (0.5f + t * (1.0f / 6 + t * (1.0f / 24 + t * (
        1.0f / 120 + t * (1.0f / 720))))));
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return below > 0.0f ? 0.0f : p * scale.f;
}
