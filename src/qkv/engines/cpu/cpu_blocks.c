/* One query block of attention, forward or backward, head by head, in one call.
 *
 * Compiled after cpu_kernels.c and cpu_weights.c, in the same library: it calls their softmax
 * and weighting steps.
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
