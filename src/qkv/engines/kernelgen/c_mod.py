"""A score modifier compiled to C tile loops from its own definition.

The modifier (``scores.py``: ALiBi, softcap, relative bias, a user's callable) is traced
(``trace.trace_score_mod``: a user's on every call, qkv's own once per structure, ``memo``)
into a graph over (score, b, h, q_idx, kv_idx, offset). This module writes that graph and
its derivatives (``derivative``) into two loops over a tile of scores (B, H, bq, bk) whose
key index is innermost, so the compiler vectorizes them; in float, exp and tanh are the
inline forms of ``c_text.FAST_MATH``:

- ``mod_scores``: scale, then the modifier, one pass (torch needs a pass per operation and
  an autograd graph per tile in the backward);
- ``mod_grads``: d(loss)/d(raw scores) from d(loss)/d(modified scores) in place, and the
  gradients of the float tensors the modifier reads that need one (ALiBi slopes, a bias
  table, a learnable cap), summed in double.

Tensors it reads that are integer or bool (document ids, bucket tables) are read as they
are. A modifier that does not trace, or reads a tensor of another type, has no loops here;
the engine then runs it with torch under autograd, as before.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor

from ..cpu import native
from . import memo
from .c import _C_TYPES, load_functions, warn_untraced
from .c_emit import CEmitter, flat_offset
from .c_text import HEADER
from .derivative import depends_on, derivative, loads_in
from .graph import FLOAT, INT, MAX_SLOTS, CompileError, Graph, Sym
from .trace import trace_score_mod

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
# Captured tensors that are not float (segment or document ids, bucket tables) are read as
# they are: their C element types. Float ones are cast to the call's dtype.
_INT_C_TYPES = {torch.int64: "int64_t", torch.int32: "int32_t", torch.int16: "int16_t",
                torch.int8: "int8_t", torch.uint8: "uint8_t", torch.bool: "uint8_t"}
_ARGS = "row[j] * scale, b0 + b, h0 + h, q, k0 + j, offset, A0, A1, A2, A3"
_ROW_ARGS = "0, b0 + b, h0 + h, q, k0, offset, A0, A1, A2, A3"  # an index of b, h, q only
_SIGNATURES = {
    "mod_scores": [_PTR, _PTR] + [_I64] * 9 + [ctypes.c_double] + [_PTR] * MAX_SLOTS,
    "mod_grads": [_PTR, _PTR] + [_I64] * 9 + [ctypes.c_double] + [_PTR] * (2 * MAX_SLOTS),
    "mod_scores_ds": [_PTR, _PTR] + [_I64] * 9 + [ctypes.c_double] + [_PTR] * MAX_SLOTS,
}


def _slot_params(slots: list[Tensor], ctype: str) -> str:
    """The slot parameters A0..A3 of the generated functions, each of its tensor's C type."""
    types = [_INT_C_TYPES.get(t.dtype, ctype) for t in slots]
    types += [ctype] * (MAX_SLOTS - len(types))
    return ", ".join(f"const {c} *A{i}" for i, c in enumerate(types))


def _function(name: str, root, ctype: str, fsuffix: str, params: str, kind: str = FLOAT,
              slope=None) -> str:
    """A C function of (score, b, h, q_idx, kv_idx, offset, slots) returning ``root``: a
    graph, a number, or a callable that writes its lines into an emitter and returns the
    result's expression. With ``slope`` (a graph or a number), it also stores that through
    a last argument ``d_score``, from the same emitter, so the operations the two share
    (softcap's tanh) are computed once."""
    e = CEmitter(ctype, fsuffix, float_literals=True)
    value = lambda x: e.ref(x) if isinstance(x, Sym) else repr(float(x or 0.0))  # noqa: E731
    result = root(e) if callable(root) else value(root)
    store = []
    if slope is not None:
        params += f", {ctype} *d_score"
        store = [f"    *d_score = {value(slope)};"]
    rtype = ctype if kind == FLOAT else "int64_t"
    return "\n".join([
        f"static inline {rtype} {name}({ctype} score, int64_t b, int64_t h, int64_t q_idx, "
        f"int64_t kv_idx, int64_t offset, {params}) {{",
        "    (void)score; (void)b; (void)h; (void)q_idx; (void)kv_idx; (void)offset;",
        *e.lines, *store, f"    return {result};", "}"])


_LOOPS = """
/* Rows r = (b * heads + h) * bq + i of a tile (batch, heads, bq, bk) of batch items b0 + b,
 * heads h0 + h, query positions q0 + i and key positions k0 + j (the C query blocks,
 * cpu_blocks.c, pass one head at a time). A select (gj != 0 ? v : 0) is written as a bit mask
 * (qkv_keep): as a select, the compiler branches around v's computation and the loop does not
 * vectorize. */
#define ROWS for (int64_t b = 0; b < batch; b++) for (int64_t h = 0; h < heads; h++) \\
    for (int64_t i = 0; i < bq; i++)

void mod_scores(const {T} *src, {T} *dst, int64_t batch, int64_t heads, int64_t bq, int64_t bk,
                int64_t q0, int64_t k0, int64_t offset, int64_t b0, int64_t h0,
                double scale_, {SLOTS}) {{
    const {T} scale = ({T})scale_;
    ROWS {{
        const int64_t q = q0 + i, r = (b * heads + h) * bq + i;
        const {T} *row = src + r * bk;
        {T} *out = dst + r * bk;
        _Pragma("omp simd")
        for (int64_t j = 0; j < bk; j++) out[j] = mod({ARGS});
    }}
}}

void mod_grads(const {T} *src, {T} *ds, int64_t batch, int64_t heads, int64_t bq, int64_t bk,
               int64_t q0, int64_t k0, int64_t offset, int64_t b0, int64_t h0,
               double scale_, {SLOTS}, {GRADS}) {{
    /* ds <- ds * d mod / d raw score; 0 where ds is 0 (masked pairs): never 0 * inf. */
    const {T} scale = ({T})scale_;
    ROWS {{
        const int64_t q = q0 + i, r = (b * heads + h) * bq + i;
        const {T} *row = src + r * bk;
        {T} *g = ds + r * bk;{SCATTER}{DECLS}
        _Pragma("omp simd{REDUCE}")
        for (int64_t j = 0; j < bk; j++) {{
            const {T} gj = g[j], dm = mod_ds({ARGS});{UPDATES}
            g[j] = {KEEP}(gj * dm * scale, gj != 0);
        }}{STORES}
    }}
}}

/* The backward's recompute, for a modifier whose only gradient is the score's: dst <- the
 * modified scores and src <- d mod / d raw score, from one evaluation per pair. */
void mod_scores_ds({T} *src, {T} *dst, int64_t batch, int64_t heads, int64_t bq, int64_t bk,
                   int64_t q0, int64_t k0, int64_t offset, int64_t b0, int64_t h0,
                   double scale_, {SLOTS}) {{
    const {T} scale = ({T})scale_;
    ROWS {{
        const int64_t q = q0 + i, r = (b * heads + h) * bq + i;
        {T} *row = src + r * bk, *out = dst + r * bk;
        _Pragma("omp simd")
        for (int64_t j = 0; j < bk; j++) {{
            {T} dm;
            out[j] = mod_pair({ARGS}, &dm);
            row[j] = dm;
        }}
    }}
}}
"""


def _source(root: Sym, grad_slots: set[int], dtype: torch.dtype) -> str:
    ctype, fsuffix = _C_TYPES[dtype]
    slots = _slot_params(root.graph.slots, ctype)
    score = root.graph.leaf("score", FLOAT)
    d_score = derivative(root, score, {})
    parts = [HEADER, _function("mod", root, ctype, fsuffix, slots),
             _function("mod_ds", 0.0 if d_score is None else d_score, ctype, fsuffix, slots),
             _function("mod_pair", root, ctype, fsuffix, slots, slope=0.0 if d_score is None
                       else d_score)]
    scatter = decls = reduce = updates = stores = ""
    for n, load in enumerate(loads_in(root).values()):
        slot, *index = load.args
        d_load = derivative(root, load, {})
        if slot not in grad_slots or d_load is None:
            continue
        parts.append(_function(f"mod_d{n}", d_load, ctype, fsuffix, slots))
        parts.append(_function(f"mod_i{n}", lambda e, load=load: flat_offset(e, load), ctype,
                               fsuffix, slots, INT))
        if any(depends_on(i, {"kv_idx", "score"}) for i in index):  # a slot element per pair
            scatter += (f"\n        for (int64_t j = 0; j < bk; j++) if (g[j] != 0) "
                        f"G{slot}[mod_i{n}({_ARGS})] += (double)(g[j] * mod_d{n}({_ARGS}));")
        else:  # one element per row: summed in registers, stored once
            decls += f"\n        double total_{n} = 0;"
            reduce += f" reduction(+:total_{n})"
            updates += (f"\n            const {ctype} d{n} = mod_d{n}({_ARGS});"
                        f"\n            total_{n} += (double)qkv_keep{fsuffix}(gj * d{n}, "
                        "gj != 0);")
            stores += f"\n        G{slot}[mod_i{n}({_ROW_ARGS})] += total_{n};"
    grads = ", ".join(f"double *G{i}" for i in range(MAX_SLOTS))
    parts.append(_LOOPS.format(T=ctype, KEEP=f"qkv_keep{fsuffix}", ARGS=_ARGS, SLOTS=slots,
                               GRADS=grads, SCATTER=scatter, DECLS=decls, REDUCE=reduce,
                               UPDATES=updates, STORES=stores))
    return "\n\n".join(parts)


class ModLoops:
    """The C loops of one traced score modifier. ``tensors``: the float tensors it reads that
    need a gradient, as autograd sees them (``grads`` returns one sum per tensor)."""

    def __init__(self, functions, slots: list[Tensor], values: list[Tensor],
                 grad_slots: list[int], needs_raw: bool, slope_is_one: bool = False):
        self._scores, self._grads, self._scores_ds = functions
        self.needs_raw = needs_raw  # whether ``grads`` reads the raw scores (softcap: yes)
        # d mod / d score = 1 and no tensor to differentiate (ALiBi, a bias table that needs
        # no gradient): ``grads`` would only multiply ds by the scale, a pass the engine skips.
        self.grads_are_scale = slope_is_one and not grad_slots
        # The backward may then keep d mod / d score from its recompute (``scores_ds``) and
        # skip the second evaluation, when no tensor the modifier reads needs a gradient.
        self.keeps_slope = needs_raw and not grad_slots
        self._values = values  # the C loops read their memory
        self.tensors = tuple(slots[i] for i in grad_slots)
        self._grad_slots, self._grad_values = grad_slots, [values[i] for i in grad_slots]
        self._dummy = torch.zeros(1, dtype=torch.float64)  # fills unused slots (never read)
        self._pointers = [v.data_ptr() for v in values] + [self._dummy.data_ptr()] * (
            MAX_SLOTS - len(values))

    def addresses(self) -> tuple[int, int, list[int]]:
        """For C callers (the C query blocks): the addresses of ``mod_scores`` and
        ``mod_scores_ds``, and the four slot pointers they read."""
        return (native.address_of(self._scores), native.address_of(self._scores_ds),
                list(self._pointers))

    @staticmethod
    def _layout(s: Tensor, q0: int, k0: int, offset: int, scale: float) -> tuple:
        if not s.is_contiguous() or s.dim() != 4:
            raise ValueError("the C modifier loops take contiguous (B, H, bq, bk) tiles")
        return (*s.shape, q0, k0, offset, 0, 0, scale)

    def scores(self, src: Tensor, dst: Tensor, q0: int, k0: int, offset: int,
               scale: float) -> Tensor:
        """dst <- score_mod(scale · src) for a tile of query positions q0... and keys k0...
        (dst may be src)."""
        self._scores(src.data_ptr(), dst.data_ptr(), *self._layout(src, q0, k0, offset, scale),
                     *self._pointers)
        return dst

    def scores_ds(self, raw: Tensor, dst: Tensor, q0: int, k0: int, offset: int,
                  scale: float) -> Tensor:
        """dst <- score_mod(scale · raw) and raw <- its derivative in the scaled score, in one
        evaluation per pair (the slope goes to ``native.softmax_grad_rows``; only when
        ``keeps_slope``)."""
        self._scores_ds(raw.data_ptr(), dst.data_ptr(), *self._layout(raw, q0, k0, offset,
                                                                     scale), *self._pointers)
        return dst

    def grads(self, src: Tensor, ds: Tensor, q0: int, k0: int, offset: int,
              scale: float) -> tuple[Tensor, ...]:
        """ds (d loss / d modified scores) <- d loss / d raw scores, in place, for the raw
        scores src (read only when ``needs_raw``); returns the gradients of ``tensors``
        (float64)."""
        sums = [torch.zeros(v.numel(), dtype=torch.float64) for v in self._grad_values]
        by_slot = dict(zip(self._grad_slots, sums, strict=True))
        sink = torch.zeros(1, dtype=torch.float64)
        pointers = [by_slot.get(i, sink).data_ptr() for i in range(MAX_SLOTS)]
        self._grads(src.data_ptr(), ds.data_ptr(), *self._layout(src, q0, k0, offset, scale),
                    *self._pointers, *pointers)
        return tuple(s.view(v.shape) for s, v in zip(sums, self._grad_values, strict=True))


_TRACES = memo.Traces()


def traced_mod(score_mod, dtype: torch.dtype) -> ModLoops | None:
    """C loops for ``score_mod`` (a ``scores.ScoreMod``) in ``dtype``, traced now or found
    traced (``memo``), reading the tensors it captures now; or None: it does not trace,
    reads a tensor of another type than float, integer or bool, or nothing builds."""
    if dtype not in _C_TYPES or not native.available(dtype):
        return None
    keyed = memo.variant_key(score_mod)
    if keyed is not None:
        key = (keyed[0], dtype, torch.is_grad_enabled())
        found = _TRACES.lookup(key, keyed[1], "cpu")
        if found is not None:
            (functions, grad_slots, needs_raw, slope_is_one), slots = found
            if _grad_slots(slots) == grad_slots:
                return ModLoops(functions, slots, _values(slots, dtype), grad_slots, needs_raw,
                                slope_is_one)
    graph = Graph("cpu")
    try:
        root = trace_score_mod(score_mod, graph)
    except Exception as e:  # noqa: BLE001  any modifier this tracer cannot follow runs in torch
        # Once per modifier's code: a lambda made anew each step is the same code.
        code = getattr(getattr(score_mod, "fn", None), "__code__", None)
        warn_untraced(f"score modifier {score_mod!r}", (type(score_mod), code), e)
        return None
    if not all(t.is_floating_point() or t.dtype in _INT_C_TYPES for t in graph.slots):
        return None
    grad_slots = _grad_slots(graph.slots)
    try:
        source = _source(root, set(grad_slots), dtype)
    except CompileError:
        return None
    functions = load_functions(source, "score_mod", _SIGNATURES)
    if functions is None:
        return None
    derivatives = [derivative(root, graph.leaf("score", FLOAT), {})] + [
        derivative(root, load, {}) for load in loads_in(root).values()
        if load.args[0] in grad_slots]
    needs_raw = any(depends_on(d, {"score"}) for d in derivatives)
    slope_is_one = not isinstance(derivatives[0], Sym) and derivatives[0] == 1
    if keyed is not None:
        _TRACES.store(key, keyed[1], (functions, grad_slots, needs_raw, slope_is_one), graph)
    return ModLoops(functions, graph.slots, _values(graph.slots, dtype), grad_slots, needs_raw,
                    slope_is_one)


def _grad_slots(slots: list[Tensor]) -> list[int]:
    return [i for i, t in enumerate(slots) if t.requires_grad]


def _values(slots: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """The slots as the C loops read them: float ones in ``dtype``, detached, contiguous."""
    return [(t.detach().to(dtype) if t.is_floating_point() else t).contiguous() for t in slots]
