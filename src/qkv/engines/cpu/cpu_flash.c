/* Dot-product attention's forward on CPU, flash-style: blocks of queries against blocks of
 * keys with an online softmax, both products in AVX-512 micro-kernels of this file.
 *
 * Built twice from this source (cpu_flash.py):
 * - bf16 products (the default): the CPU's bf16 dot-product instruction (AVX512-BF16:
 *   vdpbf16ps multiplies pairs of bf16 and adds both into a float32 lane), twice float32
 *   FMA's multiply-adds per cycle on half the bytes. Only q, k, v (unless already bf16) and
 *   the softmax weights p are rounded to bf16, as a GPU's flash attention rounds them.
 * - float32 products (-DQKV_FP32_PRODUCTS): AVX-512 FMA, float32 throughout.
 * Neither torch's CPU SDPA nor the BLAS it links runs these instructions on AMD processors.
 * Scores, the softmax and both sums are float32 either way.
 *
 * Layout. PAIR elements per float32 lane: 2 (bf16) or 1 (float32). Per (batch, kv head), K
 * is packed once as kp[key / 16][d / PAIR][16 keys][PAIR]: one 64-byte vector holds one
 * pair of dimensions for 16 keys, so a query row's pair (broadcast) times that vector gives
 * 16 scores' partial sums. V is packed as vp[key / PAIR][dv][PAIR]: one vector holds 16
 * columns of a pair of keys, which a row's pair of weights multiplies.
 * A work item is one query block of every query head that reads the kv head (grouped
 * heads share the packed K and V), rows stacked head by head and padded to a multiple of 8.
 * The softmax is online, a block of BN keys at a time.
 *
 * Built for build.march()'s target: without the instructions there, flash_available() = 0.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#define BN 128 /* keys per block: a multiple of 32 (the score micro-kernel's width) */
#define QK_ROWS 8     /* rows of the score micro-kernel */
#define PV_ROWS 4     /* rows of the output micro-kernel */

struct flash_job {
    const void *q, *k, *v;
    int64_t q_st[3], k_st[3], v_st[3]; /* element strides of batch, head, row; unit columns */
    int64_t inputs_bf16;              /* 1: q, k, v, out are bf16; 0: float32 */
    void *out;
    int64_t out_st[3];
    float *lse;                       /* (B, H, Nq) contiguous, natural log; or 0 */
    int64_t batch, heads, kv_heads, nq, nk, d, dv;
    int64_t causal;                   /* key j allowed for query i iff j <= i + nk - nq */
    int64_t bm;                       /* query rows per head in a block */
    float scale_log2;                 /* scale * log2(e) > 0: scores in base 2 */
};

static inline uint16_t round_bf16(float x) { /* to nearest, ties to even (NaN stays NaN) */
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline uint16_t input_bf16(const struct flash_job *J, const void *base, int64_t at) {
    return J->inputs_bf16 ? ((const uint16_t *)base)[at] : round_bf16(((const float *)base)[at]);
}

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* What the products read: bf16 pairs (vdpbf16ps multiplies two and adds both into one
 * float32 lane), or with QKV_FP32_PRODUCTS float32 singles (an FMA per lane). */
#ifdef QKV_FP32_PRODUCTS
typedef float elem;
#define PAIR 1
static inline elem input_elem(const struct flash_job *J, const void *base, int64_t at) {
    (void)J;
    return ((const float *)base)[at];
}
#else
typedef uint16_t elem;
#define PAIR 2
#define input_elem input_bf16
#endif

/* The kernels need the products' instructions; without them only the two functions at
 * the end of the file are built, and flash_available() = 0. */
#if defined(QKV_FP32_PRODUCTS) ? defined(__AVX512F__) : defined(__AVX512BF16__)
#include <immintrin.h>

int64_t flash_available(void) { return 1; }

/* K and V packed for the products, k_size and v_size elements per (batch, kv head):
 * k[key / 16][d / PAIR][16 keys][PAIR], v[key / PAIR][dv][PAIR], keys up to the next BN. */
struct packed {
    elem *k, *v;
    int64_t k_size, v_size;
};

/* Pack K and V of (batch b, kv head g); keys past nk (up to the next BN) are zero. */
static void pack(const struct flash_job *J, const struct packed *P, int64_t b, int64_t g) {
    const int64_t dp = J->d / PAIR, nkp = round_up(J->nk, BN);
    elem *kp = P->k + (b * J->kv_heads + g) * P->k_size;
    elem *vp = P->v + (b * J->kv_heads + g) * P->v_size;
    const int64_t k0 = b * J->k_st[0] + g * J->k_st[1], v0 = b * J->v_st[0] + g * J->v_st[1];
    for (int64_t j = 0; j < nkp; j++) {
        elem *o = kp + (j / 16) * dp * 16 * PAIR + (j % 16) * PAIR;
        for (int64_t c = 0; c < J->d; c++)
            o[(c / PAIR) * 16 * PAIR + c % PAIR] =
                j < J->nk ? input_elem(J, J->k, k0 + j * J->k_st[2] + c) : 0;
    }
    for (int64_t j = 0; j < nkp; j++) {
        elem *o = vp + (j / PAIR) * J->dv * PAIR + (j % PAIR);
        for (int64_t c = 0; c < J->dv; c++)
            o[PAIR * c] = j < J->nk ? input_elem(J, J->v, v0 + j * J->v_st[2] + c) : 0;
    }
}

#ifdef QKV_FP32_PRODUCTS
typedef __m512 operand;
static inline operand broadcast(const elem *at) { return _mm512_set1_ps(*at); }
static inline operand load_operand(const elem *at) { return _mm512_loadu_ps(at); }
static inline __m512 multiply_add(__m512 acc, operand a, operand b) {
    return _mm512_fmadd_ps(a, b, acc);
}
static inline void store_weights(elem *at, __m512 p0, __m512 p1) {
    _mm512_storeu_ps(at, p0);
    _mm512_storeu_ps(at + 16, p1);
}
#else
typedef __m512bh operand;
static inline operand broadcast(const elem *at) {
    return (__m512bh)_mm512_set1_epi32(*(const int32_t *)at);
}
static inline operand load_operand(const elem *at) { return (__m512bh)_mm512_loadu_si512(at); }
static inline __m512 multiply_add(__m512 acc, operand a, operand b) {
    return _mm512_dpbf16_ps(acc, a, b);
}
static inline void store_weights(elem *at, __m512 p0, __m512 p1) {
    _mm512_storeu_si512(at, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
}
#endif

/* 2^y for y <= 0 (or -inf): 2^round(y) times a degree-5 polynomial of the remainder in
 * [-1/2, 1/2], fitted for the least largest relative error (7.5e-8; 2.3e-7 as float32 FMAs,
 * against 3.2e-6 for the Taylor polynomial of the same degree); exactly 0 below 2^-126, so
 * masked scores (-inf) weigh nothing. */
static inline __m512 exp2_nonpositive(__m512 y) {
    __mmask16 live = _mm512_cmp_ps_mask(y, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    y = _mm512_max_ps(y, _mm512_set1_ps(-126.0f));
    __m512 n = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(y, n);
    __m512 p = _mm512_set1_ps(1.327647178e-3f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.675541333e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550713274e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402211972e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931469671e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000072f));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* s (rows, BN) = q rows (rows, d) . 32 keys starting at kp's block, for 8 rows. */
static inline void scores_8x32(const elem *q, int64_t d, const elem *kp, float *s) {
    const int64_t dp = d / PAIR;
    __m512 acc[QK_ROWS][2];
    for (int a = 0; a < QK_ROWS; a++)
        acc[a][0] = acc[a][1] = _mm512_setzero_ps();
    const elem *k1 = kp + dp * 16 * PAIR;
    for (int64_t p = 0; p < dp; p++) {
        operand b0 = load_operand(kp + p * 16 * PAIR);
        operand b1 = load_operand(k1 + p * 16 * PAIR);
        for (int a = 0; a < QK_ROWS; a++) {
            operand qa = broadcast(q + a * d + PAIR * p);
            acc[a][0] = multiply_add(acc[a][0], qa, b0);
            acc[a][1] = multiply_add(acc[a][1], qa, b1);
        }
    }
    for (int a = 0; a < QK_ROWS; a++) {
        _mm512_storeu_ps(s + a * BN, acc[a][0]);
        _mm512_storeu_ps(s + a * BN + 16, acc[a][1]);
    }
}

/* o rows (4, 16 * NZ columns) = alpha o + p (4, pairs) . vp, for `pairs` pairs of keys. */
#define DEFINE_PV(NZ)                                                                        \
static inline void out_4x##NZ(float *o, int64_t dv, const float *alpha, const elem *pb,      \
                              const elem *vp, int64_t pairs) {                              \
    __m512 acc[PV_ROWS][NZ];                                                                 \
    for (int a = 0; a < PV_ROWS; a++) {                                                      \
        __m512 al = _mm512_set1_ps(alpha[a]);                                                \
        for (int z = 0; z < NZ; z++)                                                         \
            acc[a][z] = _mm512_mul_ps(al, _mm512_loadu_ps(o + a * dv + 16 * z));             \
    }                                                                                        \
    for (int64_t t = 0; t < pairs; t++) {                                                    \
        operand w[NZ];                                                                       \
        for (int z = 0; z < NZ; z++)                                                         \
            w[z] = load_operand(vp + t * dv * PAIR + 16 * PAIR * z);                         \
        for (int a = 0; a < PV_ROWS; a++) {                                                  \
            operand pa = broadcast(pb + a * BN + PAIR * t);                                  \
            for (int z = 0; z < NZ; z++)                                                     \
                acc[a][z] = multiply_add(acc[a][z], pa, w[z]);                               \
        }                                                                                    \
    }                                                                                        \
    for (int a = 0; a < PV_ROWS; a++)                                                        \
        for (int z = 0; z < NZ; z++)                                                         \
            _mm512_storeu_ps(o + a * dv + 16 * z, acc[a][z]);                                \
}
DEFINE_PV(4)
DEFINE_PV(1)

/* Per-worker scratch, for up to `rows` stacked rows. */
struct scratch {
    elem *q, *p;
    float *s, *o, *row_max, *row_sum, *alpha;
};

/* One query block [m0, m0 + bm) of every query head of (batch b, kv head g). */
static void block(const struct flash_job *J, const struct packed *P, const struct scratch *W,
                  int64_t b, int64_t g, int64_t m0) {
    const int64_t group = J->heads / J->kv_heads, d = J->d, dv = J->dv, BM = J->bm;
    const int64_t bm = J->nq - m0 < BM ? J->nq - m0 : BM;
    const int64_t rows = round_up(group * BM, QK_ROWS);
    const int64_t offset = J->nk - J->nq;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t head = g * group + r / BM, i = r % BM;
        const int live = r < group * BM && i < bm;
        const int64_t at = b * J->q_st[0] + head * J->q_st[1] + (m0 + i) * J->q_st[2];
        for (int64_t c = 0; c < d; c++)
            W->q[r * d + c] = live ? input_elem(J, J->q, at + c) : 0;
        W->row_max[r] = -INFINITY;
        W->row_sum[r] = 0;
    }
    memset(W->o, 0, sizeof(float) * rows * dv);
    int64_t kend = J->causal ? m0 + bm + offset : J->nk;
    kend = kend > J->nk ? J->nk : kend;
    const elem *kp = P->k + (b * J->kv_heads + g) * P->k_size;
    const elem *vp = P->v + (b * J->kv_heads + g) * P->v_size;
    const __m512 scale = _mm512_set1_ps(J->scale_log2);
    for (int64_t j0 = 0; j0 < kend; j0 += BN) {
        const int64_t bn = kend - j0 < BN ? kend - j0 : BN;
        for (int64_t r0 = 0; r0 < rows; r0 += QK_ROWS)
            for (int64_t jj = 0; jj < BN; jj += 32)
                scores_8x32(W->q + r0 * d, d, kp + ((j0 + jj) / 16) * (d / PAIR) * 16 * PAIR,
                            W->s + r0 * BN + jj);
        for (int64_t r = 0; r < rows; r++) {
            float *s = W->s + r * BN;
            int64_t allowed = bn;
            if (J->causal && m0 + r % BM + offset + 1 - j0 < allowed)
                allowed = m0 + r % BM + offset + 1 - j0;
            allowed = allowed < 0 ? 0 : allowed;
            /* The max of the raw scores (the scale is positive); masked keys get -inf, which
             * exp2 turns into 0. Only a block's partial rows need the mask. */
            __m512 top = _mm512_set1_ps(-INFINITY);
            if (allowed == BN) {
                for (int64_t c = 0; c < BN; c += 16)
                    top = _mm512_max_ps(top, _mm512_loadu_ps(s + c));
            } else {
                for (int64_t c = 0; c < BN; c += 16) {
                    __mmask16 in = c >= allowed ? 0 : allowed - c >= 16 ? 0xffff
                                   : (__mmask16)((1u << (allowed - c)) - 1);
                    __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), in,
                                                  _mm512_loadu_ps(s + c));
                    _mm512_storeu_ps(s + c, x);
                    top = _mm512_max_ps(top, x);
                }
            }
            const float block_max = _mm512_reduce_max_ps(top) * J->scale_log2;
            const float m = block_max > W->row_max[r] ? block_max : W->row_max[r];
            const float safe = m == -INFINITY ? 0.0f : m;
            W->alpha[r] = W->row_max[r] == -INFINITY ? 0.0f : exp2f(W->row_max[r] - safe);
            W->row_max[r] = m;
            __m512 sum = _mm512_setzero_ps(), shift = _mm512_set1_ps(-safe);
            for (int64_t c = 0; c < BN; c += 32) {
                __m512 p0 = exp2_nonpositive(
                    _mm512_fmadd_ps(_mm512_loadu_ps(s + c), scale, shift));
                __m512 p1 = exp2_nonpositive(
                    _mm512_fmadd_ps(_mm512_loadu_ps(s + c + 16), scale, shift));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                store_weights(W->p + r * BN + c, p0, p1);
            }
            W->row_sum[r] = W->row_sum[r] * W->alpha[r] + _mm512_reduce_add_ps(sum);
        }
        const elem *vb = vp + (j0 / PAIR) * dv * PAIR;
        const int64_t pairs = (bn + PAIR - 1) / PAIR;
        for (int64_t r0 = 0; r0 < rows; r0 += PV_ROWS) {
            int64_t c0 = 0;
            for (; c0 + 64 <= dv; c0 += 64)
                out_4x4(W->o + r0 * dv + c0, dv, W->alpha + r0, W->p + r0 * BN,
                        vb + c0 * PAIR, pairs);
            for (; c0 < dv; c0 += 16)
                out_4x1(W->o + r0 * dv + c0, dv, W->alpha + r0, W->p + r0 * BN,
                        vb + c0 * PAIR, pairs);
        }
    }
    for (int64_t r = 0; r < group * BM; r++) {
        const int64_t head = g * group + r / BM, i = r % BM;
        if (i >= bm)
            continue;
        const float total = W->row_sum[r];
        const float inv = total > 0 ? 1.0f / total : 0.0f;
        const int64_t at = b * J->out_st[0] + head * J->out_st[1] + (m0 + i) * J->out_st[2];
        for (int64_t c = 0; c < dv; c++) {
            const float x = W->o[r * dv + c] * inv;
            if (J->inputs_bf16)
                ((uint16_t *)J->out)[at + c] = round_bf16(x);
            else
                ((float *)J->out)[at + c] = x;
        }
        if (J->lse)
            J->lse[(b * J->heads + head) * J->nq + m0 + i] =
                total > 0 ? (W->row_max[r] + log2f(total)) * 0.69314718055994531f : -INFINITY;
    }
}

/* Pack every (batch, kv head), then run every query block, costliest first (the last
 * queries under a causal mask) so that the last ones taken are short, on `threads` threads
 * of OpenMP's team: torch's own, since the library links the libgomp torch has loaded.
 * (Threads of another pool would share the cores with torch's OpenMP threads, which spin
 * for a while after each of torch's parallel operations: inside a model that doubled this
 * engine's time.) Returns 0, or 1 when memory ran out. */
int64_t flash_attention(const struct flash_job *J, int64_t threads) {
    const int64_t rows = round_up(J->heads / J->kv_heads * J->bm, QK_ROWS);
    const int64_t pairs = J->batch * J->kv_heads, blocks = (J->nq + J->bm - 1) / J->bm;
    const int64_t keys = round_up(J->nk, BN);
    struct packed P = {0, 0, keys * J->d, keys * J->dv};
    P.k = malloc(pairs * P.k_size * sizeof(elem));
    P.v = malloc(pairs * P.v_size * sizeof(elem));
    int failed = !P.k || !P.v;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        {
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < pairs; i++)
                pack(J, &P, i / J->kv_heads, i % J->kv_heads);
            struct scratch W = {0};
            char *memory = malloc(rows * (J->d + BN) * sizeof(elem)
                                  + rows * (BN + J->dv + 3) * sizeof(float) + 64);
            if (!memory) {
#pragma omp atomic write
                failed = 1;
            } else {
                W.s = (float *)memory;
                W.o = W.s + rows * BN;
                W.row_max = W.o + rows * J->dv;
                W.row_sum = W.row_max + rows;
                W.alpha = W.row_sum + rows;
                W.q = (elem *)(W.alpha + rows);
                W.p = W.q + rows * J->d;
            }
            /* Item i: query block blocks - 1 - i / pairs of (batch, kv head) i % pairs. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < blocks * pairs; i++)
                if (memory)
                    block(J, &P, &W, (i % pairs) / J->kv_heads, i % J->kv_heads,
                          (blocks - 1 - i / pairs) * J->bm);
            free(memory);
        }
    }
    free(P.k);
    free(P.v);
    return failed;
}
#else
int64_t flash_available(void) { return 0; }
int64_t flash_attention(const struct flash_job *J, int64_t threads) {
    (void)J, (void)threads;
    return 1;
}
#endif
