"""A traced term's gradient loops on CPU vector types, with each key's values and dk sums in
registers.

``kernelgen.c`` writes a term's gradients as scalar C that the compiler vectorizes across
lanes of d; its keys' values and dk sums then live in arrays in L1 cache, loaded and stored
for every query. The built-in L1 (``cpu_kernels.c``) holds them in vector registers instead,
which only code written with vector types gets from GCC. This module writes the term's
derivatives in q_d and k_d as functions of GCC vectors (``qkv_v``: the CPU's widest, as the
built-in's) and a loop over a group of keys like the built-in's, which takes a user's L1
gradient 0.89x the scalar loops' time (docs/performance.md, "CPU: inner loops").

It covers small terms (``MAX_OPERATIONS``) of float arithmetic, comparisons, selects and sign,
reading captured tensors at d or as scalars, whose tensors need no gradient sums; anything
else (index arithmetic, exp and the other math functions, a tensor read elsewhere, a
tensor's gradient) is a ``CompileError``, and the term keeps the scalar loops for all of d.
(A tensor's sums, kept in double per lane, make a weighted L1 with a learnable weight slower
here than on the scalar loops, and so does exp lane by lane for a Gaussian: "CPU: inner
loops" again.) The lanes of d past the last whole vector always take the scalar loops.
"""

from __future__ import annotations

from .derivative import operations_in
from .emit import COMMON_OPS, Emitter
from .graph import BOOL, FLOAT, INT, MAX_SLOTS, CompileError, Sym
from .trace import TERM_ARGS

# The vectors are the target's widest, as in cpu_kernels.c (VBYTES there): wider ones are
# pairs of registers, and a user's L1 term at -march=x86-64-v2 runs slower on 32-byte vectors
# than on 16-byte ones (docs/performance.md, "CPU: inner loops").
PRELUDE = """
#if defined(__AVX512F__)
#define VBYTES 64
#elif defined(__AVX__)
#define VBYTES 32
#else
#define VBYTES 16
#endif
typedef {T} qkv_v __attribute__((vector_size(VBYTES)));
typedef {I} qkv_vi __attribute__((vector_size(VBYTES)));
#define VL ((int64_t)(VBYTES / sizeof({T})))
/* x in every lane: -0 + x is x for every x, so this is a broadcast; +0 + x is an addition
 * the compiler keeps (it is -0 for x = -0), one more operation per key and query */
#define QV(x) (-(qkv_v){{0}} + ({T})(x))
/* a where m is all ones, else b (m from a vector comparison: all ones or all zeros) */
static inline qkv_v qkv_vsel(qkv_vi m, qkv_v a, qkv_v b) {{
    return (qkv_v)((m & (qkv_vi)a) | (~m & (qkv_vi)b));
}}
static inline qkv_vi qkv_vsel_i(qkv_vi m, qkv_vi a, qkv_vi b) {{ return (m & a) | (~m & b); }}
/* -QV(0) is -0 in every lane: the sign bits */
static inline qkv_v qkv_vabs(qkv_v x) {{ return (qkv_v)((qkv_vi)x & ~(qkv_vi)(-QV(0))); }}
static inline qkv_v qkv_vload(const {T} *p) {{ qkv_v v; memcpy(&v, p, sizeof v); return v; }}
/* *p in every lane. With AVX one load-and-broadcast: from QV(*p) GCC hoisted a group's ds
 * values out of the key loop as scalars, whose registers the keys' vectors then spilled to
 * (a user's L1 gradient loop: 1.08-1.15x -> 0.95-1.04x the built-in's time on a tile). */
#if defined(__AVX__) && VBYTES == 32
#include <immintrin.h>
#define qkv_vbroadcast(p) ((qkv_v)_mm256_broadcast_{B}(p))
#else
#define qkv_vbroadcast(p) QV(*(p))
#endif
{SIGN}
"""

# sign(x), 0 for NaN and -0 as torch.sign: 1.0 carrying x's sign bit where x is neither,
# which (x < 0) | (x > 0) tells (GCC writes it as one ordered not-equal comparison): 4 vector
# operations with AVX2, where two selects take 5 (AVX-512 takes one, below). With AVX2 in
# float, vpsignd of that comparison's mask and a convert: 3 (docs/performance.md, "CPU: inner
# loops").
_SIGN_BITS = """static inline qkv_v qkv_vsign(qkv_v x) {
    const qkv_vi neither = (x < QV(0)) | (x > QV(0));
    return (qkv_v)(((qkv_vi)QV(1) | ((qkv_vi)x & (qkv_vi)(-QV(0)))) & neither);
}"""
# 2 sign(x) where x is never NaN or -0 (``halved_sign``): 2.0 carrying x's sign bit, 0 where
# x is +0. With AVX2 in float one vpsignd of 2.0's bits (the integer negation of 2.0's bits is
# -2.0's, as for no other float), as the built-in L1's loop: 2 operations fewer than sign.
_SIGN2_BITS = """static inline qkv_v qkv_vsign2(qkv_v x) {
    return (qkv_v)(((qkv_vi)QV(2) | ((qkv_vi)x & (qkv_vi)(-QV(0)))) & (x != QV(0)));
}"""
# With AVX-512, sign(x) is one fixup-by-class operation (vfixupimm's table, 4 bits a class
# from the lowest: QNaN, SNaN, zero, +1, -inf, +inf, negative, positive; 8 is +0, 9 is -1,
# 10 is +1), as in the built-in L1's gradient; 2 sign(x) would take one more, so the halved
# form is sign itself and its sums are not halved (QKV_SIGN2_HALF).
def _sign_avx512(lanes: str, register: str, table: str) -> str:
    """The AVX-512 branch opening a type's sign functions: ``lanes`` is the intrinsics'
    suffix (ps, pd), ``register`` the __m512 type, ``table`` the broadcast's suffix."""
    return f"""#if defined(__AVX512F__)
#include <immintrin.h>
static inline qkv_v qkv_vsign(qkv_v x) {{
    return (qkv_v)_mm512_fixupimm_{lanes}(({register})x, ({register})x,
                                       _mm512_set1_{table}(0xA9A9A888), 0);
}}
#define qkv_vsign2 qkv_vsign
#define QKV_SIGN2_HALF 1
#else
#define QKV_SIGN2_HALF 0.5
"""


_SIGN = {
    "float": _sign_avx512("ps", "__m512", "epi32") + """\
#if defined(__AVX2__) && VBYTES == 32 /* immintrin.h: in the prelude, with AVX */
static inline qkv_v qkv_vsign(qkv_v x) {
    /* the integer -1 where x is neither, negated by vpsignd where x's bits as an int32 are
     * negative (its sign bit): -sign(x) */
    const __m256 neither = _mm256_cmp_ps((__m256)x, _mm256_setzero_ps(), _CMP_NEQ_OQ);
    return -(qkv_v)_mm256_cvtepi32_ps(_mm256_sign_epi32((__m256i)neither, (__m256i)x));
}
static inline qkv_v qkv_vsign2(qkv_v x) {
    return (qkv_v)_mm256_sign_epi32(_mm256_set1_epi32(0x40000000), (__m256i)x);
}
#else
""" + _SIGN_BITS + "\n" + _SIGN2_BITS + """
#endif
#endif""",
    "double": _sign_avx512("pd", "__m512d", "epi64") + _SIGN_BITS + "\n" + _SIGN2_BITS
    + "\n#endif",
}

# One group of up to GROUP_KEYS keys against every query, over ``width`` vectors of d from
# c0 (the built-in L1's l1_key_group): the keys' values and dk sums stay in registers while
# the queries stream past; each query's dq sum alternates between two registers. In float
# with AVX2 a group is 8 keys over two vectors (VW), which share each broadcast of ds and
# each pass over the queries, as in the built-in L1's loop (docs/performance.md, "CPU: inner
# loops"). ``zeros`` counts, per query, the group's keys whose ds is 0 (padding keys count
# too): a query with some skips those keys (they add 0, never 0 * inf), one with all of them
# is skipped.
GROUP = """
#if VBYTES == 32 && {WIDE}
#define VW 2 /* vectors of d per group */
#else
#define VW 1
#endif
#define GROUP_KEYS (KEYS / VW)
static inline __attribute__((always_inline)) void term_grads_vec(
        const {T} *sb, const {T} *qb, const {T} *kb, {T} *dqb, {T} *dkb, int64_t m, int64_t n,
        int64_t d, int64_t c0, int64_t keys, const uint8_t *zeros, int64_t groups, {T} scale,
        {CONST_SLOTS}, const int width) {{
    qkv_v kc[KEYS], acc[KEYS], v;
    for (int64_t u = 0; u < GROUP_KEYS; u++)
        for (int w = 0; w < width; w++) {{
            kc[u * VW + w] = acc[u * VW + w] = QV(0);
            if (u < keys) kc[u * VW + w] = qkv_vload(kb + u * d + c0 + w * VL);
        }}
    for (int64_t i = 0; i < m; i++) {{
        const {T} *gi = sb + i * n;
        const int64_t zero = zeros[i * groups];
        if (zero == GROUP_KEYS) continue;
        qkv_v x[VW], even[VW], odd[VW];
        for (int w = 0; w < width; w++) {{
            x[w] = qkv_vload(qb + i * d + c0 + w * VL);
            even[w] = odd[w] = QV(0);
        }}
        if (zero == 0) {{
            for (int64_t u = 0; u < GROUP_KEYS; u++) {{
                const qkv_v g = qkv_vbroadcast(gi + u);
                for (int w = 0; w < width; w++) {{
                    const int64_t pd = c0 + w * VL;
                    const qkv_v t = g * term_dq_v(x[w], kc[u * VW + w], pd, A0, A1, A2, A3);
                    if (u & 1) odd[w] += t; else even[w] += t;
                    acc[u * VW + w] += g * term_dk_v(x[w], kc[u * VW + w], pd, A0, A1, A2, A3);
                }}
            }}
        }} else {{
            for (int64_t u = 0; u < keys; u++) {{
                if (gi[u] == 0) continue;
                const qkv_v g = QV(gi[u]);
                for (int w = 0; w < width; w++) {{
                    const int64_t pd = c0 + w * VL;
                    even[w] += g * term_dq_v(x[w], kc[u * VW + w], pd, A0, A1, A2, A3);
                    acc[u * VW + w] += g * term_dk_v(x[w], kc[u * VW + w], pd, A0, A1, A2, A3);
                }}
            }}
        }}
        for (int w = 0; w < width; w++) {{
            v = qkv_vload(dqb + i * d + c0 + w * VL) + (even[w] + odd[w]) * scale;
            memcpy(dqb + i * d + c0 + w * VL, &v, sizeof v);
        }}
    }}
    for (int64_t u = 0; u < keys; u++)
        for (int w = 0; w < width; w++) {{
            v = qkv_vload(dkb + u * d + c0 + w * VL) + acc[u * VW + w] * scale;
            memcpy(dkb + u * d + c0 + w * VL, &v, sizeof v);
        }}
}}

/* Every group of keys over the width vectors of d from c0 (width a constant where inlined) */
static inline __attribute__((always_inline)) void term_vec_groups(
        const {T} *sb, const {T} *qb, const {T} *kb, {T} *dqb, {T} *dkb, int64_t m, int64_t n,
        int64_t d, int64_t c0, const uint8_t *zeros, int64_t groups, {T} scale, {CONST_SLOTS},
        const int width) {{
    int64_t j0 = 0;
    for (; j0 + GROUP_KEYS <= n; j0 += GROUP_KEYS)
        term_grads_vec(sb + j0, qb, kb + j0 * d, dqb, dkb + j0 * d, m, n, d, c0, GROUP_KEYS,
                       zeros + j0 / GROUP_KEYS, groups, scale, A0, A1, A2, A3, width);
    if (j0 < n)
        term_grads_vec(sb + j0, qb, kb + j0 * d, dqb, dkb + j0 * d, m, n, d, c0, n - j0,
                       zeros + j0 / GROUP_KEYS, groups, scale, A0, A1, A2, A3, width);
}}"""

# The whole vectors of d, VW at a time and then one at a time, before term_grads' scalar
# loops take the rest from c0; the counts of zero ds per query and key group once for all
# of them. Without memory for the counts, the scalar loops take all of d. ``{SCALE}`` is
# where the sums are stored: the call's scale, halved where the derivatives hold 2 sign(x).
GROUPS = """
        const int64_t groups = (n + GROUP_KEYS - 1) / GROUP_KEYS;
        uint8_t *zeros = d >= VL ? malloc((size_t)(m * groups)) : 0;
        if (zeros) {
            for (int64_t i = 0; i < m; i++)
                for (int64_t j0 = 0; j0 < n; j0 += GROUP_KEYS) {
                    const int64_t keys = n - j0 < GROUP_KEYS ? n - j0 : GROUP_KEYS;
                    int64_t zero = GROUP_KEYS - keys;
                    for (int64_t u = 0; u < keys; u++) zero += sb[i * n + j0 + u] == 0;
                    zeros[i * groups + j0 / GROUP_KEYS] = (uint8_t)zero;
                }
            for (; c0 + VW * VL <= d; c0 += VW * VL)
                term_vec_groups(sb, qb, kb, dqb, dkb, m, n, d, c0, zeros, groups, {SCALE},
                                A0, A1, A2, A3, VW);
            for (; c0 + VL <= d; c0 += VL)
                term_vec_groups(sb, qb, kb, dqb, dkb, m, n, d, c0, zeros, groups, {SCALE},
                                A0, A1, A2, A3, 1);
            free(zeros);
        }"""


class VectorEmitter(Emitter):
    """Statements on ``qkv_v`` (float lanes) and ``qkv_vi`` (comparison masks: all ones or
    zeros per lane). Integer values have no lanes here: a term that computes with d is
    declined (``CompileError``), but for reading a captured tensor at d."""

    TARGET = "C vector"

    def __init__(self, pd: Sym, halved: Sym | None = None):
        super().__init__("    ")
        self.pd = pd
        self.halved = halved  # the sign node written as 2 sign(x) (``halved_sign``)

    def literal(self, value) -> str:
        if isinstance(value, bool):
            return "((qkv_vi){0} - 1)" if value else "((qkv_vi){0})"
        return f"QV({float(value)!r})"

    def assign(self, name: str, node: Sym, expr: str) -> str:
        if node.kind == INT:
            raise CompileError("integer arithmetic has no vector form here")
        return f"const {'qkv_v' if node.kind == FLOAT else 'qkv_vi'} {name} = {expr};"

    def ref(self, value) -> str:
        if isinstance(value, Sym) and value.kind == INT:
            raise CompileError("integer values have no vector form here")
        return super().ref(value)

    def as_float(self, value) -> str:
        if isinstance(value, Sym) and value.kind == BOOL:
            return f"qkv_vsel({self.ref(value)}, QV(1), QV(0))"
        return self.ref(value)


def _load(e: VectorEmitter, node: Sym) -> str:
    slot, *index = node.args
    if not index:
        return f"QV(A{slot}[0])"
    if len(index) == 1 and index[0] is e.pd and node.graph.slots[slot].stride() == (1,):
        return f"qkv_vload(A{slot} + pd)"
    raise CompileError("a tensor read at other than d has no vector form here")


def _where(e: VectorEmitter, n: Sym) -> str:
    if n.kind == FLOAT:
        return f"qkv_vsel({e.ref(n.args[0])}, {e.as_float(n.args[1])}, {e.as_float(n.args[2])})"
    return f"qkv_vsel_i({e.ref(n.args[0])}, {e.ref(n.args[1])}, {e.ref(n.args[2])})"


def _extremum(e: VectorEmitter, n: Sym) -> str:
    a, b = e.ref(n.args[0]), e.ref(n.args[1])
    return f"qkv_vsel({a} {'<' if n.op == 'minimum' else '>'} {b}, {a}, {b})"


def _cast(e: VectorEmitter, n: Sym) -> str:
    if n.kind == FLOAT:
        return e.as_float(n.args[0])
    if n.kind == BOOL and n.args[0].kind == FLOAT:
        return f"({e.ref(n.args[0])} != QV(0))"
    if n.kind == BOOL:
        return e.ref(n.args[0])
    raise CompileError("a cast to an integer has no vector form here")


VectorEmitter.OPS = {
    **COMMON_OPS,
    "invert": lambda e, n: f"(~{e.ref(n.args[0])})",
    "abs": lambda e, n: f"qkv_vabs({e.ref(n.args[0])})",
    "minimum": _extremum,
    "maximum": _extremum,
    "sign": lambda e, n: f"qkv_vsign{'2' if n is e.halved else ''}({e.ref(n.args[0])})",
    "where": _where,
    "cast": _cast,
    "full": lambda e, n: e.literal(bool(n.args[1]) if n.kind == BOOL else float(n.args[1])),
    "load": _load,
}


def _vector_function(name: str, root, pd: Sym, ctype: str, halved: Sym | None) -> str:
    e = VectorEmitter(pd, halved)
    result = e.as_float(root) if isinstance(root, Sym) else e.literal(root or 0.0)
    slots = ", ".join(f"const {ctype} *A{i}" for i in range(MAX_SLOTS))
    return "\n".join([f"static inline qkv_v {name}(qkv_v pq, qkv_v pk, int64_t pd, {slots}) {{",
                      "    (void)pq; (void)pk; (void)pd;", *e.lines,
                      f"    return {result};", "}"])


# The vector loop holds 2 x KEYS vectors of keys and sums; a term's derivatives past this
# many operations spill them, and the scalar loops are faster for them (docs/performance.md,
# "CPU: inner loops": |q-k| with 8 operations and a weighted |q-k| with 9 run faster on the
# vector loop, -|q-k| q with 13 and -|q-k|^3 with 22 slower).
MAX_OPERATIONS = 10


def _free_of(node, s: Sym) -> bool:
    return not isinstance(node, Sym) or id(s) not in operations_in(node)


def _linear_in(node, s: Sym) -> bool:
    """Whether ``node`` is s times factors free of s, or sums of such products (then it
    doubles exactly where s does)."""
    if node is s:
        return True
    if not isinstance(node, Sym) or node.op not in ("neg", "mul", "add", "sub"):
        return False
    if node.op == "neg":
        return _linear_in(node.args[0], s)
    a, b = node.args
    if node.op in ("add", "sub"):
        return _linear_in(a, s) and _linear_in(b, s)
    return (_linear_in(a, s) and _free_of(b, s)) or (_free_of(a, s) and _linear_in(b, s))


def halved_sign(d_q, d_k) -> Sym | None:
    """The sign node that the derivatives may hold as 2 sign(x), their sums halved where
    stored, or None. That is exact, but for sums past half the float range and in its
    subnormal range, when: the node is sign(q_d - k_d) or sign(k_d - q_d), the caller has
    checked that q and k hold no NaN, infinity or -0 (so x is never NaN or -0: only -0 - +0
    is -0), and both derivatives are sums of that sign times factors free of it (zero counts
    too), so every sum doubles exactly. The L1 terms are: -|q_d - k_d|, also weighted."""
    signs = [n for n in operations_in(d_k, operations_in(d_q)).values() if n.op == "sign"]
    if len(signs) != 1:
        return None
    s, x = signs[0], signs[0].args[0]
    leaves = sorted(a.args[0] for a in getattr(x, "args", ()) if isinstance(a, Sym)
                    and a.op == "arg")
    if not (isinstance(x, Sym) and x.op == "sub" and leaves == sorted(TERM_ARGS[:2])):
        return None
    return s if all(d is None or _linear_in(d, s) for d in (d_q, d_k)) else None


def vector_groups(d_q, d_k, pd: Sym, ctype: str, const_slots: str,
                  halved: Sym | None = None) -> tuple[str, str]:
    """(functions, loop) for a term whose derivatives in q_d and k_d are ``d_q`` and ``d_k``
    (graphs or numbers): the C that goes before ``c_text.TERM_LOOPS`` and the loop over whole
    vectors of d that goes into its ``term_grads``. ``halved``: ``halved_sign``'s node, for
    q and k the caller has checked hold no NaN, infinity or -0; written in its halved form.
    A ``CompileError`` when a derivative has no vector form (an integer value, exp and the
    other math functions, which have none here), or the two have more than
    ``MAX_OPERATIONS`` together."""
    count = len(operations_in(d_k, operations_in(d_q)))
    if count > MAX_OPERATIONS:
        raise CompileError(f"the derivatives have {count} operations; the vector loop takes "
                           f"{MAX_OPERATIONS} at most")
    itype = "int32_t" if ctype == "float" else "int64_t"
    functions = [PRELUDE.format(T=ctype, I=itype, B="ss" if ctype == "float" else "sd",
                                SIGN=_SIGN[ctype]),
                 _vector_function("term_dq_v", d_q, pd, ctype, halved),
                 _vector_function("term_dk_v", d_k, pd, ctype, halved),
                 GROUP.format(T=ctype, CONST_SLOTS=const_slots, WIDE=int(ctype == "float"))]
    return "\n\n".join(functions), GROUPS.replace(
        "{SCALE}", "scale" if halved is None else "(scale * QKV_SIGN2_HALF)")
