"""The C target of the emitter: ``CEmitter`` and its table of what each operation of a traced
graph is in C, in float or double.

Slot reads index the contiguous slot arrays ``A0`` to ``A3`` with constant strides
(``flat_offset``). The table writes calls to the helpers of ``c_text.HEADER``
(``qkv_floordiv``, ``qkv_i64_to_f64``, and in float the inline ``qkv_expf`` and
``qkv_tanhf``); with ``fma_sub``, a float subtraction in a term's score loop is a
multiply-add.
"""

from __future__ import annotations

import math

from .emit import COMMON_OPS, Emitter
from .graph import BOOL, FLOAT, INT, Sym


def _literal(value) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, float):
        if math.isnan(value):
            return "NAN"
        if math.isinf(value):
            return "INFINITY" if value > 0 else "(-INFINITY)"
        return repr(value)
    return f"{value}LL"


class CEmitter(Emitter):
    """C statements in type ``ctype`` (float or double; ``fsuffix`` picks libm's functions)."""

    TARGET = "C"

    def __init__(self, ctype: str, fsuffix: str, float_literals: bool = False,
                 fma_sub: bool = False):
        super().__init__("    ")
        self.ctype, self.fsuffix = ctype, fsuffix
        self.float_literals = float_literals and ctype == "float"
        self.fma_sub = fma_sub  # float a - b as fma(b, -1, a): see _c_sub

    def literal(self, value) -> str:
        # A double literal makes the float arithmetic around it double (twice the vector
        # work, with conversions): modifiers take float literals. Terms keep double ones,
        # which their tensors' gradient sums need (they cancel over each softmax row).
        text = _literal(value)
        is_finite = isinstance(value, float) and text[-1].isdigit()
        return f"{text}f" if is_finite and self.float_literals else text

    def assign(self, name: str, node: Sym, expr: str) -> str:
        kind = {FLOAT: self.ctype, INT: "int64_t", BOOL: "int"}[node.kind]
        return f"const {kind} {name} = {expr};"

    def as_float(self, value) -> str:
        if isinstance(value, Sym) and value.kind == INT:  # vectorizable (c_text.HEADER)
            return f"(({self.ctype})qkv_i64_to_f64({self.ref(value)}))"
        return f"(({self.ctype}){self.ref(value)})"


def _c_sub(e: CEmitter, node: Sym) -> str:
    """a - b; in a term's score loop, where the running sum keeps the adders busy, a float
    difference is fma(b, -1, a): the same number (the exact difference, rounded once) from
    the multiply-add units, 0.9x the time of a subtraction in a user L1's scores
    (docs/performance.md, "CPU: inner loops"). The -1 is a global the compiler cannot fold
    back."""
    a, b = e.ref(node.args[0]), e.ref(node.args[1])
    if e.fma_sub and node.kind == FLOAT:
        return f"fma{e.fsuffix}({b}, qkv_minus_one{e.fsuffix}, {a})"
    return f"({a} - {b})"


def _c_floordiv_mod(e: CEmitter, node: Sym) -> str:
    a, b = e.ref(node.args[0]), e.ref(node.args[1])
    if node.kind == FLOAT:
        floor = f"floor{e.fsuffix}({e.as_float(node.args[0])} / {e.as_float(node.args[1])})"
        return floor if node.op == "floordiv" else f"({a} - {b} * {floor})"
    return f"qkv_{node.op}({a}, {b})"


def _c_extremum(e: CEmitter, node: Sym) -> str:
    a, b = e.ref(node.args[0]), e.ref(node.args[1])
    return f"({a} {'<' if node.op == 'minimum' else '>'} {b} ? {a} : {b})"


def _c_cast(e: CEmitter, node: Sym) -> str:
    if node.kind == FLOAT:
        return e.as_float(node.args[0])
    a = e.ref(node.args[0])
    return f"((int64_t){a})" if node.kind == INT else f"({a} != 0)"


def flat_offset(e: CEmitter, load: Sym) -> str:
    """The element offset a slot read ``load`` reads at: slots are contiguous, so their
    strides are constants of the source."""
    slot, *index = load.args
    strides = load.graph.slots[slot].stride()
    terms = [e.ref(i) if stride == 1 else f"{e.ref(i)} * {stride}LL"
             for i, stride in zip(index, strides, strict=True)]
    return " + ".join(terms) or "0"


def _c_load(e: CEmitter, node: Sym) -> str:
    return f"A{node.args[0]}[{flat_offset(e, node)}]"


# In float, exp and tanh are the header's inline forms (``c_text.FAST_MATH``): libm's are calls the
# compiler cannot vectorize. double keeps libm's (exact to the float64 tests' 1e-12).
_INLINE = {("exp", "f"): "qkv_expf", ("tanh", "f"): "qkv_tanhf"}


def _c_math(name: str):
    return lambda e, n: (f"{_INLINE.get((name, e.fsuffix), name + e.fsuffix)}"
                         f"({e.as_float(n.args[0])})")


CEmitter.OPS = {
    **COMMON_OPS,
    **{op: _c_math(op) for op in ("exp", "log", "sqrt", "sin", "cos", "tanh")},
    "sub": _c_sub,
    "floordiv": _c_floordiv_mod,
    "mod": _c_floordiv_mod,
    "invert": lambda e, n: (f"(!{e.ref(n.args[0])})" if n.args[0].kind == BOOL
                            else f"(~{e.ref(n.args[0])})"),
    "abs": lambda e, n: (f"fabs{e.fsuffix}({e.ref(n.args[0])})" if n.kind == FLOAT
                         else f"llabs({e.ref(n.args[0])})"),
    "sigmoid": lambda e, n: (f"(1 / (1 + {_INLINE.get(('exp', e.fsuffix), 'exp' + e.fsuffix)}"
                             f"(-{e.as_float(n.args[0])})))"),
    "minimum": _c_extremum,
    "maximum": _c_extremum,
    # 0 for NaN and -0, as torch.sign; the comparisons' difference vectorizes without a branch
    "sign": lambda e, n: f"(({e.ctype})(({e.ref(n.args[0])} > 0) - ({e.ref(n.args[0])} < 0)))",
    "where": lambda e, n: f"({e.ref(n.args[0])} ? {e.ref(n.args[1])} : {e.ref(n.args[2])})",
    "cast": _c_cast,
    "full": lambda e, n: _literal({FLOAT: float, INT: int, BOOL: bool}[n.kind](n.args[1])),
    "load": _c_load,
}
