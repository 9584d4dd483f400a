/* A C-level run of the tile kernels (cpu_kernels.c, linked in) and the team runner
 * (workers_team.c), for a machine whose Python has no torch: tests/core/test_native_aarch64.py
 * builds it for aarch64 and for this machine, runs both and compares what they print with
 * each other and with torch in float64.
 *
 * The inputs are one stream of the generator below (next_value), array after array in the
 * order they are filled here; the test draws the same stream. Each output prints as
 * "name count" and then its values in C's exact hexadecimal form (%a), one a line. */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define DECLARE(T, S)                                                                       \
    void l1_scores_##S(const T *, const T *, T *, int64_t, int64_t, int64_t, int64_t,       \
                       int64_t, int64_t, T *);                                              \
    void l1_grads_##S(const T *, const T *, const T *, T *, T *, int64_t, int64_t, int64_t, \
                      int64_t, int64_t, int64_t, int64_t, int64_t);                         \
    void online_softmax_step_##S(T *, int64_t, int64_t, T *, T *, T *, int64_t,             \
                                 const uint8_t *, int64_t, int64_t, int64_t, int64_t);      \
    void softmax_grad_rows_##S(const T *, T *, int64_t, int64_t, const T *, const T *,      \
                               double);                                                     \
    int64_t edge_scores_##S(int64_t, const T *, const T *, const int64_t *,                 \
                            const int64_t *, T *, int64_t, int64_t, int64_t, int64_t,       \
                            int64_t, int64_t, int64_t);                                     \
    int64_t edge_kernel_grads_##S(int64_t, const T *, const T *, const T *,                 \
                                  const int64_t *, const int64_t *, T *, T *, int64_t,      \
                                  int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);
DECLARE(float, f32)
DECLARE(double, f64)
int64_t l1_vector_bytes(void);
void qkv_run_on_team(int64_t count, void (*job)(int64_t));

/* Shapes, as test_native_aarch64.py reads them: NB batch items of M queries and N keys of
 * D dims (a multiple of every target's lanes), and E graph edges over NODES nodes. */
enum { NB = 2, M = 37, N = 70, D = 48, BLOCK = 64, E = 90, NODES = 11, HEADS = 2 };

static uint64_t state = 12345;

/* Uniform in [-1, 1) with 24 bits: exact in float and double. */
static double next_value(void) {
    state = state * 6364136223846793005u + 1442695040888963407u;
    return (double)(state >> 40) / (double)(1 << 23) - 1.0;
}

static void *filled(int64_t count, int is_double) {
    void *p = malloc((size_t)count * (is_double ? 8 : 4));
    for (int64_t i = 0; i < count; i++) {
        const double x = next_value();
        if (is_double)
            ((double *)p)[i] = x;
        else
            ((float *)p)[i] = (float)x;
    }
    return p;
}

static void print(const char *name, const void *p, int64_t count, int is_double) {
    printf("%s %" PRId64 "\n", name, count);
    for (int64_t i = 0; i < count; i++)
        printf("%a\n", is_double ? ((const double *)p)[i] : (double)((const float *)p)[i]);
}

/* One dtype's kernels; every output is printed as "<kernel>_<suffix>". */
#define RUN(T, S, IS_DOUBLE)                                                                \
    static void run_##S(void) {                                                             \
        T *q = filled(NB * M * D, IS_DOUBLE), *k = filled(NB * N * D, IS_DOUBLE);           \
        T *ds = filled(NB * M * N, IS_DOUBLE);                                              \
        T *scores = calloc(NB * M * N, sizeof(T)), *kt = calloc(BLOCK * D, sizeof(T));      \
        T *dq = calloc(NB * M * D, sizeof(T)), *dk = calloc(NB * N * D, sizeof(T));         \
        l1_scores_##S(q, k, scores, NB, M, N, D, M * D, N * D, kt);                         \
        print("l1_scores_" #S, scores, NB * M * N, IS_DOUBLE);                              \
        l1_grads_##S(ds, q, k, dq, dk, NB, M, N, D, M * D, N * D, M * D, N * D);            \
        print("l1_dq_" #S, dq, NB * M * D, IS_DOUBLE);                                      \
        print("l1_dk_" #S, dk, NB * N * D, IS_DOUBLE);                                      \
        /* The online softmax on the L1 scores, (NB * M) rows with no max yet; every third  \
         * key forbidden. */                                                                \
        T *row_max = malloc(NB * M * sizeof(T)), *row_sum = calloc(NB * M, sizeof(T));      \
        T *acc = filled(NB * M * 3, IS_DOUBLE);                                             \
        uint8_t *allowed = malloc(M * N);                                                   \
        for (int64_t i = 0; i < NB * M; i++) row_max[i] = -(T)__builtin_inf();              \
        for (int64_t i = 0; i < M * N; i++) allowed[i] = i % 3 != 0;                        \
        online_softmax_step_##S(scores, NB * M, N, row_max, row_sum, acc, 3, allowed, 1, M, \
                                0, 0);                                                      \
        print("softmax_p_" #S, scores, NB * M * N, IS_DOUBLE);                              \
        print("softmax_sum_" #S, row_sum, NB * M, IS_DOUBLE);                               \
        print("softmax_max_" #S, row_max, NB * M, IS_DOUBLE);                               \
        softmax_grad_rows_##S(scores, ds, NB * M, N, row_sum, 0, 1.0);                      \
        print("softmax_grad_" #S, ds, NB * M * N, IS_DOUBLE);                               \
        /* Graph edges: HEADS query heads, one key head, for each built-in term. */         \
        int64_t target[E], source[E];                                                       \
        for (int64_t e = 0; e < E; e++) {                                                   \
            target[e] = (e * 7) % NODES;                                                    \
            source[e] = (e * 5 + e / NODES) % NODES;                                        \
        }                                                                                   \
        T *qn = filled(NB * NODES * HEADS * D, IS_DOUBLE), *kn = filled(NB * NODES * D,     \
                                                                       IS_DOUBLE);          \
        T *ge = filled(NB * E * HEADS, IS_DOUBLE), *edge = calloc(NB * E * HEADS, sizeof(T)); \
        const int64_t terms[] = {QKV_TERM_DOT, QKV_TERM_SQDIST, QKV_TERM_L1};               \
        for (int64_t i = 0; i < 3; i++) {                                                   \
            const int64_t term = terms[i];                                                  \
            T *gq = calloc(NB * NODES * HEADS * D, sizeof(T));                              \
            T *gk = calloc(NB * NODES * D, sizeof(T));                                      \
            if (edge_scores_##S(term, qn, kn, target, source, edge, NB, E, NODES, NODES,    \
                                HEADS, 1, D) ||                                             \
                edge_kernel_grads_##S(term, ge, qn, kn, target, source, gq, gk, NB, E,      \
                                      NODES, NODES, HEADS, 1, D))                           \
                exit(2);                                                                    \
            char name[32];                                                                  \
            snprintf(name, sizeof name, "edge%d_scores_" #S, (int)term);                    \
            print(name, edge, NB * E * HEADS, IS_DOUBLE);                                   \
            snprintf(name, sizeof name, "edge%d_dq_" #S, (int)term);                        \
            print(name, gq, NB * NODES * HEADS * D, IS_DOUBLE);                             \
            snprintf(name, sizeof name, "edge%d_dk_" #S, (int)term);                        \
            print(name, gk, NB * NODES * D, IS_DOUBLE);                                     \
            free(gq);                                                                       \
            free(gk);                                                                       \
        }                                                                                   \
        free(q), free(k), free(ds), free(scores), free(kt), free(dq), free(dk);             \
        free(row_max), free(row_sum), free(acc), free(allowed), free(qn), free(kn);         \
        free(ge), free(edge);                                                               \
    }
RUN(float, f32, 0)
RUN(double, f64, 1)

static double ran[4];

static void job(int64_t i) { ran[i] += (double)(i + 1); }

int main(void) {
    printf("vector_bytes %" PRId64 "\n", l1_vector_bytes());
    run_f32();
    run_f64();
    qkv_run_on_team(4, job); /* each job runs once, whatever the team's size: 1, 2, 3, 4 */
    print("team", ran, 4, 1);
    return 0;
}
