"""The Triton target of the emitter: ``TritonEmitter`` and its table of what each operation of
a traced graph is in ``@triton.jit`` code over tiles.

Slot reads take their strides from the slot info tensor (the last entry of ``SLOTS``); tanh
and integer floor division become calls to ``_tanh`` and ``_floordiv``, which the generated
module's header (``triton._HEADER``) defines. An integer expression over positions below
``POSITION_LIMIT`` that is cast to float is computed in float from the positions
(``TritonEmitter``).
"""

from __future__ import annotations

import math

from .emit import COMMON_OPS, Emitter
from .graph import BOOL, FLOAT, INT, MAX_SLOTS, SLOT_INFO, Sym


def _info(k: int) -> str:
    """Entry ``k`` of the slot info tensor (SLOTS' last)."""
    return f"tl.load(SLOTS[{MAX_SLOTS}] + {k})"


_TL_UNARY = {"exp": "tl.exp", "log": "tl.log", "sqrt": "tl.sqrt", "sin": "tl.sin", "cos": "tl.cos",
             "sigmoid": "_sigmoid", "tanh": "_tanh"}


def _literal(value) -> str:
    if isinstance(value, float) and value != value:
        return 'float("nan")'
    if isinstance(value, float) and abs(value) == float("inf"):
        return 'float("inf")' if value > 0 else 'float("-inf")'
    return repr(value)


def _is_number(value) -> bool:
    return isinstance(value, (bool, int, float))


# Positions (q_idx, kv_idx, offset) below this bound are exact in float32, and so is every
# sum of up to _POSITION_TERMS of them (with small integer constants): below 2**24.
POSITION_LIMIT = 2**20
_POSITION_TERMS = 15
_POSITION_LEAVES = ("q_idx", "kv_idx", "offset")
_POSITION_OPS = ("add", "sub", "neg", "abs", "minimum", "maximum")


def _position_terms(value) -> int | None:
    """How many position-sized terms an integer expression over q_idx, kv_idx and offset adds
    up (an integer constant counts as ceil(|c| / POSITION_LIMIT)); None for other
    expressions."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return -(-abs(value) // POSITION_LIMIT)
    if not isinstance(value, Sym) or value.kind != INT:
        return None
    if value.op == "arg":
        return 1 if value.args[0] in _POSITION_LEAVES else None
    if value.op not in _POSITION_OPS:
        return None
    total = 0
    for arg in value.args:
        terms = _position_terms(arg)
        if terms is None:
            return None
        total += terms
    return total


class TritonEmitter(Emitter):
    """Lines of a ``@triton.jit`` function body over tiles.

    With ``float_positions`` (every position of the call below POSITION_LIMIT), an integer
    expression over positions that is cast to float (ALiBi's |q - k|) is computed in float
    from the positions cast first: they are (rows, 1) and (1, keys) vectors, so the tile
    gets one float subtraction instead of integer arithmetic and a conversion per score
    (ALiBi's full-tile loops: test_triton_compile.py counts their instructions)."""

    TARGET = "Triton"

    def __init__(self, indent: str = "    ", parent: TritonEmitter | None = None,
                 float_positions: bool = False):
        super().__init__(indent, parent)
        self.float_positions = parent.float_positions if parent else float_positions
        self.float_names: dict[int, str] = dict(parent.float_names) if parent else {}

    def float_position(self, value) -> str:
        """An integer position expression (``_position_terms``) computed in float."""
        if not isinstance(value, Sym):
            return repr(float(value))
        if id(value) not in self.float_names:
            if value.op == "arg":
                expr = f"{value.args[0]}.to(tl.float32)"
            elif value.op in ("abs", "neg"):
                op = "tl.abs" if value.op == "abs" else "-"
                expr = f"{op}({self.float_position(value.args[0])})"
            elif value.op in ("minimum", "maximum"):
                a, b = (self.float_position(x) for x in value.args)
                expr = f"tl.{value.op}({a}, {b})"
            else:
                a, b = (self.float_position(x) for x in value.args)
                expr = f"({a} {'+' if value.op == 'add' else '-'} {b})"
            name = self.new_name()
            self.line(f"{name} = {expr}")
            self.float_names[id(value)] = name
        return self.float_names[id(value)]

    def literal(self, value) -> str:
        return _literal(value)

    def assign(self, name: str, node: Sym, expr: str) -> str:
        return f"{name} = {expr}"

    def as_float(self, value) -> str:
        text = self.ref(value)
        if isinstance(value, Sym) and value.kind != FLOAT:
            return f"{text}.to(tl.float32)"
        return text

    def offset(self, slot: int, index) -> str:
        """The element offset of ``index`` into slot ``slot``, from its strides in the info."""
        terms = [
            f"{self.ref(i)} * {_info(SLOT_INFO * slot + d)}"
            for d, i in enumerate(index)
            if not (isinstance(i, int) and i == 0)
        ]
        return " + ".join(terms) if terms else "0"


def _tl_extremum(e: TritonEmitter, node: Sym) -> str:
    conv = e.as_float if node.kind == FLOAT else e.ref
    a, b = node.args
    if not isinstance(a, Sym):
        a, b = b, a
    return f"tl.{node.op}({conv(a)}, {conv(b)})"


def _tl_where(e: TritonEmitter, node: Sym) -> str:
    conv = e.as_float if node.kind == FLOAT else e.ref
    return f"tl.where({e.ref(node.args[0])}, {conv(node.args[1])}, {conv(node.args[2])})"


def _tl_cast(e: TritonEmitter, node: Sym) -> str:
    if node.kind == FLOAT and e.float_positions:
        terms = _position_terms(node.args[0])
        if terms is not None and terms <= _POSITION_TERMS:
            return e.float_position(node.args[0])
    a = e.ref(node.args[0])
    if node.kind == FLOAT:
        return f"{a}.to(tl.float32)"
    if node.kind == INT:
        return f"{a}.to(tl.int32)"
    return f"({a} != 0)"


def _tl_full(e: TritonEmitter, node: Sym) -> str:
    like, value = node.args
    if not isinstance(like, Sym):
        return _literal(value)
    zero = f"({e.ref(like)}.to(tl.int32) * 0)"
    if node.kind == BOOL:
        return f"({zero} {'==' if value else '!='} 0)"
    return f"({zero} + {_literal(value)})" if node.kind == INT else f"({zero} + {float(value)!r})"


def _tl_floordiv_mod(e: TritonEmitter, node: Sym) -> str:
    a, b = node.args
    if node.kind == FLOAT:
        fa, fb = e.as_float(a), e.as_float(b)
        floor = f"tl.floor({fa} / {fb})"
        return floor if node.op == "floordiv" else f"({fa} - {fb} * {floor})"
    ra, rb = e.ref(a), e.ref(b)
    if isinstance(b, int) and b > 0:
        quotient = f"tl.where({ra} >= 0, {ra} // {rb}, -(({rb} - 1 - {ra}) // {rb}))"
    else:
        quotient = f"_floordiv({ra}, {rb})"
    return quotient if node.op == "floordiv" else f"({ra} - {rb} * {quotient})"


def _tl_load(e: TritonEmitter, node: Sym) -> str:
    slot, *index = node.args
    text = f"tl.load(SLOTS[{slot}] + {e.offset(slot, index)})"
    if node.kind == BOOL:
        return f"({text} != 0)"
    return f"{text}.to(tl.float32)" if node.kind == FLOAT else text


def _tl_searchsorted(e: TritonEmitter, node: Sym) -> str:
    """Binary search of ``values`` in the sorted 1-D slot. The trip count (the bit length of
    its size) is read at run time, so one compiled kernel serves every size."""
    slot, values, right = node.args
    v = e.ref(values)
    lo, hi = e.new_name(), e.new_name()
    info = SLOT_INFO * slot
    e.line(f"{lo} = {v} * 0")
    e.line(f"{hi} = {lo} + {_info(info + 4)}.to(tl.int32)")
    e.line(f"for _ in range({_info(info + 5)}.to(tl.int32)):")
    inner = e.indent + "    "
    go = "<=" if right else "<"
    e.lines += [
        f"{inner}active = {lo} < {hi}",
        f"{inner}mid = ({lo} + {hi}) // 2",
        f"{inner}key = tl.load(SLOTS[{slot}] + mid * {_info(info)}, mask=active, other=0)",
        f"{inner}right = active & (key {go} {v})",
        f"{inner}{lo} = tl.where(right, mid + 1, {lo})",
        f"{inner}{hi} = tl.where(active & (right == 0), mid, {hi})",
    ]
    return lo


def _tl_truediv(e: TritonEmitter, node: Sym) -> str:
    """a / b without IEEE rounding (2 ulp; a constant divisor as its reciprocal, 1 ulp more):
    the rounded division is a dozen instructions and a slow path per score."""
    a, b = node.args
    if _is_number(b) and b != 0 and math.isfinite(1.0 / b):
        return f"({e.as_float(a)} * {1.0 / b!r})"
    return f"tl.fdiv({e.as_float(a)}, {e.as_float(b)})"


def _tl_unary(function: str):
    return lambda e, n: f"{function}({e.as_float(n.args[0])})"


TritonEmitter.OPS = {
    **COMMON_OPS,
    **{op: _tl_unary(function) for op, function in _TL_UNARY.items()},
    "truediv": _tl_truediv,
    "floordiv": _tl_floordiv_mod,
    "mod": _tl_floordiv_mod,
    "invert": lambda e, n: (f"({e.ref(n.args[0])} == 0)" if n.args[0].kind == BOOL
                            else f"(~{e.ref(n.args[0])})"),
    "abs": lambda e, n: f"tl.abs({e.ref(n.args[0])})",
    "minimum": _tl_extremum,
    "maximum": _tl_extremum,
    "sign": lambda e, n: (f"tl.where({e.ref(n.args[0])} > 0, 1.0, "
                          f"tl.where({e.ref(n.args[0])} < 0, -1.0, 0.0))"),
    "where": _tl_where,
    "cast": _tl_cast,
    "full": _tl_full,
    "load": _tl_load,
    "searchsorted": _tl_searchsorted,
}
