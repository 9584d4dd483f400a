/* One query block of attention, forward or backward, head by head, in one call.
 *
 * Compiled after cpu_kernels.c, in the same library: it calls that file's softmax steps.
 * The products are BLAS's (sgemm_ / dgemm_, the ones torch itself links, found by the
 * caller and passed in), on one head's tile at a time, so a tile's scores (bq x span) stay in
 * the core's L2 cache between the products and the softmax pass; all heads of a tile at
 * once stream several megabytes through L3 per operation. One call per query block also
 * replaces a dozen Python-level calls per tile.
 *
 * Matrices are row-major with unit column stride; a (B, H, N, X) tensor is described by its
 * element strides for batch, head and row (struct qkv_blocks), so slices and transposed
 * layouts are read in place. Query head h reads key/value head h / (heads / kv_heads).
 * Column-major BLAS sees a row-major matrix as its transpose, hence the operand order below.
 */
#include <math.h>

/* Whether a term's scores are products of its features (BLAS), else its C loops'. */
#define QKV_BY_PRODUCTS(term) ((term) == QKV_TERM_DOT || (term) == QKV_TERM_SQDIST)

struct qkv_blocks {
    void *gemm;          /* sgemm_ or dgemm_ (Fortran interface; integers passed as int64) */
    int64_t batch, heads, kv_heads, nq, nk, d, dv;
    /* The term's kind (engines/lowering.py TermKind, by name from the compile flags):
     * QKV_TERM_DOT: scores sq.sk; QKV_TERM_SQDIST: -|q-k|^2 as min(sq.sk, 0) of the lifted
     * features [q, |q|^2, 1] and [2k, -1, -|k|^2] (sd = d + 2), whose gradient in q and k
     * adds -2 rowsum(ds) q and -2 colsum(ds) k to the products' (similarity.
     * neg_sqdist_tile_grads); QKV_TERM_L1 and QKV_TERM_TRACED: a term's C loops, L1's own
     * (l1_term_*) or generated (kernelgen/c.py), with the signature of the generated ones:
     * rows of q and k d apart. */
    int64_t term, sd;
    void *term_scores, *term_grads;
    const void *term_slots[4];
    void *term_sums[4];  /* the loops' tensor gradient sums: never written here (none needed) */
    double term_scale;
    const void *sq, *sk;
    int64_t sq_st[3], sk_st[3];
    double scale;        /* multiplies q.k (1 when folded into q, or with a modifier) */
    double grad_scale;   /* multiplies d(loss)/d(score) in dq and dk (scale, 1 with a slope) */
    /* A score modifier's generated loops (kernelgen/c_mod.py), or 0: mod_scores writes
     * mod(mod_scale * s); mod_scores_ds (backward, when the modifier's slope depends on the
     * score) also leaves d mod / d s in its source, which scales the softmax's gradient. */
    void *mod_scores, *mod_scores_ds;
    const void *mod_slots[4];
    double mod_scale;
    int64_t offset;      /* Nk - Nq, as the modifier reads it */
    const void *q, *k, *v; /* q and k: the term's features, which dq and dk are for */
    int64_t q_st[3], k_st[3], v_st[3];
    void *out, *lse;     /* forward: out strided; lse (B, H, Nq) contiguous */
    int64_t out_st[3];
    const void *dout, *delta; /* backward: dout strided; lse and delta (B, H, Nq) contiguous */
    int64_t dout_st[3];
    void *dq;            /* backward: written rows, strided */
    int64_t dq_st[3];
    /* How scores become weights (engines/lowering.py WeightsKind, by name from the compile
     * flags): QKV_WEIGHTS_SOFTMAX; QKV_WEIGHTS_ELEMENTWISE, whose function ends the
     * modifier's loops (a tile's weights are its modified scores, 0 where masked, rows not
     * normalized, lse 0, d(loss)/d(score) dp times the slope); QKV_WEIGHTS_SOFTPICK
     * (relu(e^s - 1) / (sum |e^s - 1| + weights_eps), max kept >= 0, lse = log of the
     * denominator); QKV_WEIGHTS_STICK (stick-breaking over the keys before each query, or up
     * to it with weights_self; spans visited from the nearest; lse = the softplus mass). */
    int64_t weights;
    double weights_eps;
    int64_t weights_self;
};

/* The mask rows of span s for (b, h): a (bq, cols) block of bytes, or 0 for an unmasked span. */
static inline const uint8_t *span_mask(const uint8_t *const *masks, const int64_t *mask_st,
                                       int64_t s, int64_t b, int64_t h) {
    return masks[s] ? masks[s] + b * mask_st[2 * s] + h * mask_st[2 * s + 1] : 0;
}

static inline int64_t widest_span(int64_t nspans, const int64_t *spans) {
    int64_t w = 0;
    for (int64_t s = 0; s < nspans; s++)
        w = spans[2 * s + 1] - spans[2 * s] > w ? spans[2 * s + 1] - spans[2 * s] : w;
    return w;
}

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
        /* Masked and unmasked rows loop apart: a test of the mask pointer inside the loop  \
         * keeps it from vectorizing. */                                                    \
        if (allowed) {                                                                      \
            _Pragma("omp simd reduction(max:m)")                                            \
            for (int64_t j = 0; j < cols; j++) {                                            \
                const T v = row[j], x = allowed[j] ? v : 0;                                 \
                m = x > m ? x : m;                                                          \
            }                                                                               \
        } else {                                                                            \
            _Pragma("omp simd reduction(max:m)")                                            \
            for (int64_t j = 0; j < cols; j++) m = row[j] > m ? row[j] : m;                 \
        }                                                                                   \
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

#define DEFINE_BLOCKS(T, SUFFIX)                                                            \
typedef void (*gemm_##SUFFIX##_t)(const char *, const char *, const int64_t *,              \
                                  const int64_t *, const int64_t *, const T *, const T *,   \
                                  const int64_t *, const T *, const int64_t *, const T *,   \
                                  T *, const int64_t *);                                    \
typedef void (*term_scores_##SUFFIX##_t)(const T *, const T *, T *, int64_t, int64_t,       \
                                         int64_t, int64_t, int64_t, int64_t, T *, double,   \
                                         const void *, const void *, const void *,          \
                                         const void *);                                     \
typedef void (*term_grads_##SUFFIX##_t)(const T *, const T *, const T *, T *, T *, int64_t,  \
                                        int64_t, int64_t, int64_t, int64_t, int64_t,        \
                                        int64_t, int64_t, double, const void *,             \
                                        const void *, const void *, const void *, void *,   \
                                        void *, void *, void *);                            \
                                                                                            \
/* L1's own loops (cpu_kernels.c) under the generated loops' signature; they read no       \
 * tensor, and the blocks give them scale 1. */                                             \
void l1_term_scores_##SUFFIX(const T *q, const T *k, T *out, int64_t nb, int64_t m,         \
                             int64_t n, int64_t d, int64_t q_step, int64_t k_step, T *kt,   \
                             double scale, const void *a0, const void *a1, const void *a2,  \
                             const void *a3) {                                              \
    (void)scale; (void)a0; (void)a1; (void)a2; (void)a3;                                    \
    l1_scores_##SUFFIX(q, k, out, nb, m, n, d, q_step, k_step, kt);                         \
}                                                                                           \
void l1_term_grads_##SUFFIX(const T *ds, const T *q, const T *k, T *dq, T *dk, int64_t nb,  \
                            int64_t m, int64_t n, int64_t d, int64_t q_step, int64_t k_step, \
                            int64_t dq_step, int64_t dk_step, double scale, const void *a0, \
                            const void *a1, const void *a2, const void *a3, void *g0,       \
                            void *g1, void *g2, void *g3) {                                 \
    (void)scale; (void)a0; (void)a1; (void)a2; (void)a3;                                    \
    (void)g0; (void)g1; (void)g2; (void)g3;                                                 \
    l1_grads_##SUFFIX(ds, q, k, dq, dk, nb, m, n, d, q_step, k_step, dq_step, dk_step);     \
}                                                                                           \
                                                                                            \
typedef void (*mod_##SUFFIX##_t)(T *, T *, int64_t, int64_t, int64_t, int64_t, int64_t,     \
                                 int64_t, int64_t, int64_t, int64_t, double, const void *,  \
                                 const void *, const void *, const void *);                 \
                                                                                            \
/* One head's raw scores (rows x cols) of query rows sqh and keys skh, into s; kt: the    \
 * C loops' scratch (BLOCK x sd). */                                                        \
static inline void scores_##SUFFIX(const struct qkv_blocks *c, const T *sqh, const T *skh,  \
                                   int64_t rows, int64_t cols, T *s, T *kt) {               \
    const T scale = (T)c->scale, alpha = c->term == QKV_TERM_SQDIST ? 1 : scale, zero = 0;  \
    if (!QKV_BY_PRODUCTS(c->term)) {                                                        \
        ((term_scores_##SUFFIX##_t)c->term_scores)(sqh, skh, s, 1, rows, cols, c->sd, 0, 0, \
                                                   kt, c->term_scale, c->term_slots[0],     \
                                                   c->term_slots[1], c->term_slots[2],      \
                                                   c->term_slots[3]);                       \
        if (scale != 1)                                                                     \
            for (int64_t e = 0; e < rows * cols; e++) s[e] *= scale;                        \
        return;                                                                             \
    }                                                                                       \
    ((gemm_##SUFFIX##_t)c->gemm)("T", "N", &cols, &rows, &c->sd, &alpha, skh, &c->sk_st[2], \
                                 sqh, &c->sq_st[2], &zero, s, &cols);                       \
    /* clamped (only rounding makes it positive; NaN stays), then scaled */                 \
    if (c->term == QKV_TERM_SQDIST)                                                         \
        for (int64_t e = 0; e < rows * cols; e++) s[e] = (s[e] > 0 ? 0 : s[e]) * scale;     \
}                                                                                           \
                                                                                            \
/* -|q-k|^2's gradient beyond the products (QKV_TERM_SQDIST): dq_i -= g rowsum_i(ds) q_i and \
 * dk_j -= g colsum_j(ds) k_j, with col (cols) as scratch. */                               \
static inline void sqdist_sums_##SUFFIX(const struct qkv_blocks *c, const T *ds,            \
                                        int64_t rows, int64_t cols, T g, const T *qh,       \
                                        const T *kh, T *dqh, T *dkh, T *col) {              \
    memset(col, 0, sizeof(T) * cols);                                                       \
    for (int64_t i = 0; i < rows; i++) {                                                    \
        const T *row = ds + i * cols;                                                       \
        T total = 0;                                                                        \
        _Pragma("omp simd reduction(+:total)")                                              \
        for (int64_t j = 0; j < cols; j++) {                                                \
            total += row[j];                                                                \
            col[j] += row[j];                                                               \
        }                                                                                   \
        for (int64_t x = 0; x < c->d; x++)                                                  \
            dqh[i * c->dq_st[2] + x] -= g * total * qh[i * c->q_st[2] + x];                 \
    }                                                                                       \
    for (int64_t j = 0; j < cols; j++)                                                      \
        for (int64_t x = 0; x < c->d; x++)                                                  \
            dkh[j * c->d + x] -= g * col[j] * kh[j * c->k_st[2] + x];                       \
}                                                                                           \
                                                                                            \
/* A term's C loops add its gradients (L1, traced), from ds times g. */                     \
static inline void term_grads_##SUFFIX(const struct qkv_blocks *c, T *ds, int64_t rows,      \
                                       int64_t cols, T g, const T *qh, const T *kh, T *dqh, \
                                       T *dkh) {                                            \
    if (g != 1)                                                                             \
        for (int64_t e = 0; e < rows * cols; e++) ds[e] *= g;                               \
    ((term_grads_##SUFFIX##_t)c->term_grads)(ds, qh, kh, dqh, dkh, 1, rows, cols, c->d, 0, 0, \
                                             0, 0, c->term_scale, c->term_slots[0],         \
                                             c->term_slots[1], c->term_slots[2],            \
                                             c->term_slots[3], c->term_sums[0],             \
                                             c->term_sums[1], c->term_sums[2],              \
                                             c->term_sums[3]);                              \
}                                                                                           \
                                                                                            \
/* The modifier on one head's tile, src -> dst (which may be src). */                       \
static inline void modify_##SUFFIX(const struct qkv_blocks *c, void *fn, T *src, T *dst,   \
                                   int64_t rows, int64_t cols, int64_t q0, int64_t k0,      \
                                   int64_t b, int64_t h) {                                  \
    ((mod_##SUFFIX##_t)fn)(src, dst, 1, 1, rows, cols, q0, k0, c->offset, b, h,             \
                           c->mod_scale, c->mod_slots[0], c->mod_slots[1], c->mod_slots[2], \
                           c->mod_slots[3]);                                                \
}                                                                                           \
                                                                                            \
/* Rows q0..q1 of out and lse from the key spans [k0, k1) (pairs in `spans`). scratch:     \
 * (q1 - q0) * (widest span + dv + 2) + BLOCK * sd + widest span elements. */               \
void block_forward_##SUFFIX(const struct qkv_blocks *c, int64_t q0, int64_t q1,             \
                            int64_t nspans, const int64_t *spans,                          \
                            const uint8_t *const *masks, const int64_t *mask_st,           \
                            T *scratch) {                                                   \
    const gemm_##SUFFIX##_t gemm = (gemm_##SUFFIX##_t)c->gemm;                              \
    const int64_t rows = q1 - q0, group = c->heads / c->kv_heads;                           \
    const T one = 1;                                                                        \
    T *s = scratch, *acc = s + rows * widest_span(nspans, spans), *row_max = acc + rows * c->dv, \
      *row_sum = row_max + rows, *kt = row_sum + rows;                                      \
    const T *sq = c->sq, *sk = c->sk, *v = c->v;                                            \
    T *out = c->out, *lse = c->lse;                                                         \
    for (int64_t b = 0; b < c->batch; b++)                                                  \
        for (int64_t h = 0; h < c->heads; h++) {                                            \
            const T *sqh = sq + b * c->sq_st[0] + h * c->sq_st[1] + q0 * c->sq_st[2];       \
            const T *skh = sk + b * c->sk_st[0] + (h / group) * c->sk_st[1];                \
            const T *vh = v + b * c->v_st[0] + (h / group) * c->v_st[1];                    \
            memset(acc, 0, sizeof(T) * rows * c->dv);                                       \
            for (int64_t i = 0; i < rows; i++) {                                            \
                /* softmax's running max starts at -inf, softpick's at its floor 0; the    \
                 * stick keeps there what the keys seen left of it, at first all of it */   \
                row_max[i] = c->weights == QKV_WEIGHTS_SOFTMAX ? -(T)__builtin_inf()        \
                    : c->weights == QKV_WEIGHTS_STICK ? 1 : 0;                              \
                row_sum[i] = 0;                                                             \
            }                                                                               \
            for (int64_t n = 0; n < nspans; n++) {                                          \
                const int64_t sp = c->weights == QKV_WEIGHTS_STICK ? nspans - 1 - n : n;    \
                const int64_t k0 = spans[2 * sp], cols = spans[2 * sp + 1] - k0;            \
                scores_##SUFFIX(c, sqh, skh + k0 * c->sk_st[2], rows, cols, s, kt);         \
                if (c->mod_scores)                                                          \
                    modify_##SUFFIX(c, c->mod_scores, s, s, rows, cols, q0, k0, b, h);      \
                const uint8_t *allowed = span_mask(masks, mask_st, sp, b, h);               \
                switch (c->weights) {                                                       \
                case QKV_WEIGHTS_SOFTMAX:                                                   \
                    online_softmax_step_##SUFFIX(s, rows, cols, row_max, row_sum, acc,      \
                                                 c->dv, allowed, 1, rows, 0, 0);            \
                    break;                                                                  \
                case QKV_WEIGHTS_ELEMENTWISE:                                               \
                    zero_masked_##SUFFIX(s, rows, cols, allowed);                           \
                    break;                                                                  \
                case QKV_WEIGHTS_SOFTPICK:                                                  \
                    softpick_step_##SUFFIX(s, rows, cols, row_max, row_sum, acc, c->dv,     \
                                           allowed);                                        \
                    break;                                                                  \
                case QKV_WEIGHTS_STICK:                                                     \
                    stick_weights_##SUFFIX(s, s, rows, cols, row_max, allowed,              \
                                           q0 + c->offset, k0, c->weights_self,             \
                                           kt + BLOCK * c->sd);                             \
                    break;                                                                  \
                }                                                                           \
                gemm("N", "N", &c->dv, &rows, &cols, &one, vh + k0 * c->v_st[2],            \
                     &c->v_st[2], s, &cols, &one, acc, &c->dv);                             \
            }                                                                               \
            T *oh = out + b * c->out_st[0] + h * c->out_st[1] + q0 * c->out_st[2];          \
            T *lh = lse + (b * c->heads + h) * c->nq + q0;                                  \
            for (int64_t i = 0; i < rows; i++) {                                            \
                const T sum = row_sum[i];                                                   \
                T div = 1, l = 0;                                                           \
                switch (c->weights) {                                                       \
                case QKV_WEIGHTS_SOFTMAX:                                                   \
                    div = sum == 0 ? 1 : sum;                                               \
                    l = (row_max[i] == -(T)__builtin_inf() ? 0 : row_max[i]) + log(sum);    \
                    break;                                                                  \
                case QKV_WEIGHTS_ELEMENTWISE:                                               \
                    break;                                                                  \
                case QKV_WEIGHTS_SOFTPICK: /* Z = sum + eps e^-m, in units of e^m */        \
                    div = sum + (T)c->weights_eps * exp(-row_max[i]);                       \
                    l = row_max[i] + log(div);                                              \
                    break;                                                                  \
                case QKV_WEIGHTS_STICK: /* the softplus mass: -log of the stick left */     \
                    l = -log(row_max[i]);                                                   \
                    break;                                                                  \
                }                                                                           \
                for (int64_t j = 0; j < c->dv; j++)                                         \
                    oh[i * c->out_st[2] + j] = acc[i * c->dv + j] / div;                    \
                lh[i] = l;                                                                  \
            }                                                                               \
        }                                                                                   \
}                                                                                           \
                                                                                            \
/* Rows q0..q1 of dq (written), and their share of dk (B, Hk, Nk, d) and dv transposed     \
 * (B, Hk, dv, Nk), both contiguous (added to). lse is +inf on rows with no allowed key.  \
 * scratch: (3 (q1 - q0) + 1) * (widest span) + BLOCK * sd elements (2 (q1 - q0) + 1     \
 * tiles without mod_scores_ds). */                                                         \
void block_backward_##SUFFIX(const struct qkv_blocks *c, int64_t q0, int64_t q1,            \
                             int64_t nspans, const int64_t *spans,                         \
                             const uint8_t *const *masks, const int64_t *mask_st,          \
                             T *dk, T *dvt, T *scratch) {                                   \
    const gemm_##SUFFIX##_t gemm = (gemm_##SUFFIX##_t)c->gemm;                              \
    const int64_t rows = q1 - q0, group = c->heads / c->kv_heads, nk = c->nk;               \
    const T one = 1, zero = 0,                                                              \
        grad_scale = (T)c->grad_scale * (c->term == QKV_TERM_SQDIST ? 2 : 1);               \
    const int64_t tile = rows * widest_span(nspans, spans);                                 \
    /* s: the scores, then with mod_scores_ds the modifier's slope; p: the probabilities */  \
    T *s = scratch, *dp = s + tile, *p = c->mod_scores_ds ? dp + tile : s;                  \
    T *col = (c->mod_scores_ds ? p : dp) + tile, *kt = col + tile / rows;                   \
    /* softpick and the stick: the weights apart from the scores their gradient reads, and  \
     * the stick's two row sums (the stick left and d(loss)/d(log weight) of later keys)   \
     * and two rows of its shares */                                                        \
    T *w = kt + BLOCK * c->sd, *spent = w + tile, *later = spent + rows, *shares = later + rows; \
    const int apart = c->weights == QKV_WEIGHTS_SOFTPICK || c->weights == QKV_WEIGHTS_STICK; \
    const T *q = c->q, *k = c->k, *sq = c->sq, *sk = c->sk, *v = c->v, *dout = c->dout,     \
            *lse = c->lse, *delta = c->delta;                                               \
    T *dq = c->dq;                                                                          \
    for (int64_t b = 0; b < c->batch; b++)                                                  \
        for (int64_t h = 0; h < c->heads; h++) {                                            \
            const int64_t hk = h / group, row0 = (b * c->heads + h) * c->nq + q0;           \
            const T *qh = q + b * c->q_st[0] + h * c->q_st[1] + q0 * c->q_st[2];            \
            const T *kh = k + b * c->k_st[0] + hk * c->k_st[1];                             \
            const T *sqh = sq + b * c->sq_st[0] + h * c->sq_st[1] + q0 * c->sq_st[2];       \
            const T *skh = sk + b * c->sk_st[0] + hk * c->sk_st[1];                         \
            const T *vh = v + b * c->v_st[0] + hk * c->v_st[1];                             \
            const T *doh = dout + b * c->dout_st[0] + h * c->dout_st[1] + q0 * c->dout_st[2]; \
            T *dqh = dq + b * c->dq_st[0] + h * c->dq_st[1] + q0 * c->dq_st[2];             \
            T *dkh = dk + (b * c->kv_heads + hk) * nk * c->d;                               \
            T *dvh = dvt + (b * c->kv_heads + hk) * c->dv * nk;                             \
            for (int64_t i = 0; i < rows; i++)                                              \
                memset(dqh + i * c->dq_st[2], 0, sizeof(T) * c->d);                         \
            if (c->weights == QKV_WEIGHTS_STICK)                                            \
                for (int64_t i = 0; i < rows; i++) {                                        \
                    spent[i] = 1; /* the stick left: all of it */                           \
                    later[i] = 0;                                                           \
                }                                                                           \
            for (int64_t n = 0; n < nspans; n++) {                                          \
                const int64_t sp = c->weights == QKV_WEIGHTS_STICK ? nspans - 1 - n : n;    \
                const int64_t k0 = spans[2 * sp], cols = spans[2 * sp + 1] - k0;            \
                scores_##SUFFIX(c, sqh, skh + k0 * c->sk_st[2], rows, cols, s, kt);         \
                if (c->mod_scores_ds)                                                       \
                    modify_##SUFFIX(c, c->mod_scores_ds, s, p, rows, cols, q0, k0, b, h);   \
                else if (c->mod_scores)                                                     \
                    modify_##SUFFIX(c, c->mod_scores, s, s, rows, cols, q0, k0, b, h);      \
                const uint8_t *allowed = span_mask(masks, mask_st, sp, b, h);               \
                const T *slope = c->mod_scores_ds ? s : 0;                                  \
                switch (c->weights) { /* p: the scores, then (softmax, elementwise) weights */ \
                case QKV_WEIGHTS_SOFTMAX:                                                   \
                    exp_sub_rows_##SUFFIX(p, rows, cols, lse + row0, allowed, 1, rows, 0, 0); \
                    break;                                                                  \
                case QKV_WEIGHTS_ELEMENTWISE:                                               \
                    zero_masked_##SUFFIX(p, rows, cols, allowed);                           \
                    break;                                                                  \
                case QKV_WEIGHTS_SOFTPICK:                                                  \
                    softpick_weights_##SUFFIX(p, w, rows, cols, lse + row0, allowed);       \
                    break;                                                                  \
                case QKV_WEIGHTS_STICK:                                                     \
                    stick_weights_##SUFFIX(p, w, rows, cols, spent, allowed, q0 + c->offset, \
                                           k0, c->weights_self, col);                       \
                    break;                                                                  \
                }                                                                           \
                gemm("T", "N", &cols, &rows, &c->dv, &one, vh + k0 * c->v_st[2],            \
                     &c->v_st[2], doh, &c->dout_st[2], &zero, dp, &cols);                   \
                gemm("N", "T", &cols, &c->dv, &rows, &one, apart ? w : p, &cols, doh,       \
                     &c->dout_st[2], &one, dvh + k0, &nk);                                  \
                switch (c->weights) {                                                       \
                case QKV_WEIGHTS_SOFTMAX:                                                   \
                    softmax_grad_rows_##SUFFIX(p, dp, rows, cols, delta + row0, slope,      \
                                               c->mod_scale);                               \
                    break;                                                                  \
                case QKV_WEIGHTS_ELEMENTWISE:                                               \
                    weight_grad_##SUFFIX(dp, rows, cols, slope, c->mod_scale, allowed);     \
                    break;                                                                  \
                case QKV_WEIGHTS_SOFTPICK:                                                  \
                    softpick_grad_##SUFFIX(p, dp, rows, cols, lse + row0, delta + row0,     \
                                           allowed);                                        \
                    break;                                                                  \
                case QKV_WEIGHTS_STICK:                                                     \
                    stick_grad_##SUFFIX(p, w, dp, rows, cols, delta + row0, later, allowed, \
                                        q0 + c->offset, k0, c->weights_self, shares);       \
                    break;                                                                  \
                }                                                                           \
                if (apart && slope)                                                         \
                    weight_grad_##SUFFIX(dp, rows, cols, slope, c->mod_scale, 0);           \
                if (!QKV_BY_PRODUCTS(c->term)) {                                            \
                    term_grads_##SUFFIX(c, dp, rows, cols, grad_scale, qh,                  \
                                        kh + k0 * c->k_st[2], dqh, dkh + k0 * c->d);        \
                    continue;                                                               \
                }                                                                           \
                gemm("N", "N", &c->d, &rows, &cols, &grad_scale, kh + k0 * c->k_st[2],      \
                     &c->k_st[2], dp, &cols, &one, dqh, &c->dq_st[2]);                      \
                gemm("N", "T", &c->d, &cols, &rows, &grad_scale, qh, &c->q_st[2], dp,       \
                     &cols, &one, dkh + k0 * c->d, &c->d);                                  \
                if (c->term == QKV_TERM_SQDIST)                                             \
                    sqdist_sums_##SUFFIX(c, dp, rows, cols, grad_scale, qh,                 \
                                         kh + k0 * c->k_st[2], dqh, dkh + k0 * c->d, col);  \
            }                                                                               \
        }                                                                                   \
}

DEFINE_BLOCKS(float, f32)
DEFINE_BLOCKS(double, f64)
