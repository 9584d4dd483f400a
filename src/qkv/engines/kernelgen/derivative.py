"""Forward-mode derivatives of a traced graph, as graphs: what the C and Triton targets
write out for a term's gradients in q_d and k_d, a score modifier's in the score, and either's
in every captured tensor it reads."""

from __future__ import annotations

from .graph import FLOAT, CompileError, Sym


def _is_num(value) -> bool:
    return isinstance(value, (bool, int, float))


# -- forward-mode derivatives of a traced graph ----------------------------------------------
def _plus(a, b):
    if a is None:
        return b
    return a if b is None else a + b


def _times(a, b):
    if a is None or b is None:
        return None
    if _is_num(a) and a == 1:
        return b
    return a if _is_num(b) and b == 1 else a * b


def _neg(a):
    return None if a is None else -a


def derivative(node, leaf: Sym, memo: dict[int, object]):
    """∂node/∂leaf as a graph (or a number), None meaning zero. Integer and boolean values,
    comparisons and index arithmetic carry no derivative."""
    if not isinstance(node, Sym) or node.kind != FLOAT:
        return None
    if node is leaf:
        return 1.0
    if id(node) in memo:
        return memo[id(node)]
    op, args = node.op, node.args
    d = [derivative(a, leaf, memo) for a in args] if op not in ("arg", "load") else []
    g = node.graph
    if op in ("arg", "load", "full", "floordiv", "sign"):
        result = None
    elif op == "add":
        result = _plus(d[0], d[1])
    elif op == "sub":
        result = _plus(d[0], _neg(d[1]))
    elif op == "mul":
        result = _plus(_times(d[0], args[1]), _times(args[0], d[1]))
    elif op == "truediv":
        a, b = args
        result = _plus(_times(d[0], 1.0 / b), _neg(_times(d[1], node / b)))
    elif op == "mod":
        result = _plus(d[0], _neg(_times(d[1], g.node("floordiv", (args[0], args[1]), FLOAT))))
    elif op == "neg":
        result = _neg(d[0])
    elif op == "abs":
        result = _times(d[0], args[0].sign())
    elif op == "exp":
        result = _times(d[0], node)
    elif op == "log":
        result = _times(d[0], 1.0 / args[0])
    elif op == "tanh":
        result = _times(d[0], 1.0 - node * node)
    elif op == "sigmoid":
        result = _times(d[0], node * (1.0 - node))
    elif op == "sqrt":
        result = _times(d[0], 0.5 / node)
    elif op == "sin":
        result = _times(d[0], args[0].cos())
    elif op == "cos":
        result = _neg(_times(d[0], args[0].sin()))
    elif op in ("minimum", "maximum"):
        a, b = args
        pick_a = (a <= b) if op == "minimum" else (a >= b)
        result = _select(g, pick_a, d[0], d[1])
    elif op == "where":
        result = _select(g, args[0], d[1], d[2])
    elif op == "cast":
        result = d[0] if args[0].kind == FLOAT else None
    else:
        raise CompileError(f"no derivative rule for the operation {op!r}")
    memo[id(node)] = result
    return result


def _select(g, cond, a, b):
    if a is None and b is None:
        return None
    return g.node("where", (cond, 0.0 if a is None else a, 0.0 if b is None else b), FLOAT)


def depends_on(node, names: set[str]) -> bool:
    """Whether ``node`` reads any of the named leaves."""
    if not isinstance(node, Sym):
        return False
    if node.op == "arg":
        return node.args[0] in names
    return any(depends_on(a, names) for a in node.args)


def operations_in(node, found: dict[int, Sym] | None = None) -> dict[int, Sym]:
    """Every operation under ``node`` (leaves excluded), by node id, in the order first met,
    added to ``found``; each shared node is visited once."""
    found = {} if found is None else found
    if isinstance(node, Sym) and node.op != "arg" and id(node) not in found:
        found[id(node)] = node
        for a in node.args:
            operations_in(a, found)
    return found


def loads_in(node) -> dict[int, Sym]:
    """Every captured-tensor load under ``node``, by node id, in the order first met."""
    return {key: n for key, n in operations_in(node).items() if n.op == "load"}
