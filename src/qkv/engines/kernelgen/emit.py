"""One emitter for every target: a traced graph written out as straight-line code.

Each node gets one local, assigned after its operands (post-order), so a value used twice is
computed once. A target (``c_emit.CEmitter``, ``triton_emit.TritonEmitter``) is a subclass with a
table ``OPS`` of what each operation's expression is in its language, how it writes a constant
and how it assigns a local. An operation missing from a target's table is a ``CompileError``
naming it, so the engine that asked can decline the call with that reason.
"""

from __future__ import annotations

from collections.abc import Callable

from .graph import CompileError, Sym


class Emitter:
    TARGET = ""
    OPS: dict[str, Callable[[Emitter, Sym], str]] = {}

    def __init__(self, indent: str = "    ", parent: Emitter | None = None):
        self.indent = indent
        self.lines: list[str] = []
        self.names: dict[int, str] = dict(parent.names) if parent else {}
        self._count = parent._count if parent else 0

    def new_name(self) -> str:
        self._count += 1
        return f"t{self._count}"

    def line(self, text: str) -> None:
        self.lines.append(self.indent + text)

    def literal(self, value) -> str:
        raise NotImplementedError

    def assign(self, name: str, node: Sym, expr: str) -> str:
        raise NotImplementedError

    def as_float(self, value) -> str:
        """``value`` in the target's float type."""
        raise NotImplementedError

    def ref(self, value) -> str:
        """The local (or literal) holding ``value``, emitting its line on first use."""
        if not isinstance(value, Sym):
            return self.literal(value)
        if id(value) not in self.names:
            if value.op == "arg":
                self.names[id(value)] = value.args[0]
            else:
                expr = self.expr(value)  # emits the operands' lines first
                name = self.new_name()
                self.line(self.assign(name, value, expr))
                self.names[id(value)] = name
        return self.names[id(value)]

    def expr(self, node: Sym) -> str:
        write = self.OPS.get(node.op)
        if write is None:
            raise CompileError(
                f"the {self.TARGET} code generator has no form of the operation {node.op!r}")
        return write(self, node)


def infix(symbol: str) -> Callable[[Emitter, Sym], str]:
    """``(a <symbol> b)``, the same in C and Triton."""
    return lambda e, n: f"({e.ref(n.args[0])} {symbol} {e.ref(n.args[1])})"


INFIX = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^",
         "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}

# Operations written alike in C and Triton (``as_float``: a target's cast to its float type).
COMMON_OPS: dict[str, Callable[[Emitter, Sym], str]] = {
    **{op: infix(symbol) for op, symbol in INFIX.items()},
    "truediv": lambda e, n: f"({e.as_float(n.args[0])} / {e.as_float(n.args[1])})",
    "neg": lambda e, n: f"(-{e.ref(n.args[0])})",
}
