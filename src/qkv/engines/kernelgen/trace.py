"""Tracing a mask rule, a score modifier or a similarity's pairwise term into an expression
graph (``graph``) that an engine can compile (the targets: ``kernelgen.c`` and
``kernelgen.triton``).

The single definitions in ``masks``, ``scores.py`` and ``similarity.py`` are ordinary torch
code. An engine calls them once per request with symbolic stand-ins (``Sym``) for ``score``,
``b``, ``h``, ``q_idx``, ``kv_idx`` and ``offset`` (or a term's q_d, k_d and d); every
operator, torch function and tensor lookup they perform records a node instead of computing.
A code generator then writes the graph out, with its derivatives (``derivative``). This is
how FlexAttention derives its kernels from ``score_mod`` / ``mask_mod``, done here with a
small tracer instead of TorchDynamo. Here are the torch functions a traced value goes
through (``torch_function``, which ``Sym.__torch_function__`` calls) and the three entry
points. Anything that cannot become straight-line code raises ``CompileError`` naming it.
"""

from __future__ import annotations

from torch import Tensor

from .graph import (
    BOOL,
    FLOAT,
    INT,
    CompileError,
    Graph,
    Sym,
    arith_kind,
    index_into,
    kind_of,
    kind_of_dtype,
)

# torch functions that are a traced value's method of the same name
_METHODS = ("exp", "log", "tanh", "sigmoid", "sqrt", "sin", "cos", "abs", "neg", "clamp", "clip",
            "clamp_min", "clamp_max", "square", "rsqrt", "sign", "relu", "reciprocal")


def torch_function(graph: Graph, func, args: tuple, kwargs: dict):
    """``func(*args, **kwargs)`` where some argument is a value traced into ``graph``: a node.
    The trace functions below install it on their graph (``Graph.torch_function``)."""
    name = getattr(func, "__name__", repr(func))
    handler = TORCH_HANDLERS.get(name)
    if handler is not None:
        return handler(graph, *args, **kwargs)
    if name.startswith("__") and isinstance(args[0], Tensor):  # tensor <op> traced value
        return getattr(graph.lift(args[0]), name)(*args[1:])
    if name in _METHODS:
        return getattr(graph.lift(args[0]), name)(*args[1:], **kwargs)
    raise CompileError(f"torch.{name} has no form in the kernel generators (C and Triton)")


def _where(graph, cond, x, y):
    cond, x, y = graph.lift(cond), graph.lift(x), graph.lift(y)
    kind = BOOL if kind_of(x) == kind_of(y) == BOOL else arith_kind(x, y)
    return graph.node("where", (cond, x, y), kind)


def _extremum(op):
    def handler(graph, a, b):
        a, b = graph.lift(a), graph.lift(b)
        return graph.node(op, (a, b), arith_kind(a, b))

    return handler


def _filled(fill):
    def handler(graph, like, *args, dtype=None, **kwargs):
        like = graph.lift(like)
        kind = kind_of_dtype(dtype) if dtype is not None else kind_of(like)
        return graph.full(like, fill if fill is not None else args[0], kind)

    return handler


def _tensor_to(graph, tensor, *args, **kwargs):
    # ``table.to(score)``: the kernel reads every captured float tensor in fp32 anyway.
    return tensor if isinstance(tensor, Tensor) else tensor.to(*args, **kwargs)


def _searchsorted(graph, sorted_sequence, values, *, right=False, side=None, **kwargs):
    if not isinstance(sorted_sequence, Tensor) or sorted_sequence.dim() != 1:
        raise CompileError("torch.searchsorted compiles only for a captured 1-D sorted tensor")
    if kwargs.get("sorter") is not None or kwargs.get("out_int32") or kwargs.get("out") is not None:
        raise CompileError("torch.searchsorted: sorter, out and out_int32 do not compile")
    right = right or side == "right"
    slot = graph.slot(sorted_sequence)
    return graph.node("searchsorted", (slot, graph.lift(values), right), INT)


def _binary(method: str):
    """torch.mul(a, b) and friends (also what ``tensor * traced`` dispatches to)."""

    def handler(graph, a, b, **kwargs):
        if kwargs:
            raise CompileError(f"torch.{method.strip('_')} with keyword arguments does not compile")
        return getattr(graph.lift(a), method)(b)

    return handler


TORCH_HANDLERS = {
    "add": _binary("__add__"),
    "sub": _binary("__sub__"),
    "mul": _binary("__mul__"),
    "div": _binary("__truediv__"),
    "true_divide": _binary("__truediv__"),
    "pow": _binary("__pow__"),
    "where": _where,
    "minimum": _extremum("minimum"),
    "maximum": _extremum("maximum"),
    "zeros_like": _filled(0),
    "ones_like": _filled(1),
    "full_like": _filled(None),
    "__getitem__": index_into,
    "to": _tensor_to,
    "searchsorted": _searchsorted,
}


def trace_mask(mask, graph: Graph) -> Sym | bool:
    """The mask rule as a graph over (b, h, q_idx, kv_idx, offset)."""
    g = graph
    g.torch_function = torch_function
    return g.lift(
        mask.mask_mod(
            g.leaf("b", INT), g.leaf("h", INT), g.leaf("q_idx", INT), g.leaf("kv_idx", INT),
            g.leaf("offset", INT),
        )
    )


TERM_ARGS = ("pq", "pk", "pd")  # the generated term functions' q_d, k_d and d


def trace_term(term, graph: Graph) -> Sym:
    """A similarity's per-dimension term as a graph over (q_d, k_d) and the dimension d."""
    g = graph
    g.torch_function = torch_function
    pq, pk = g.leaf(TERM_ARGS[0], FLOAT), g.leaf(TERM_ARGS[1], FLOAT)
    g.per_dim = g.leaf(TERM_ARGS[2], INT)
    try:
        out = g.lift(term(pq, pk))
    finally:
        g.per_dim = None
    if not isinstance(out, Sym):
        raise CompileError("the pairwise term returned a constant; it must depend on q_d, k_d")
    return out._cast(FLOAT)


def trace_score_mod(score_mod, graph: Graph) -> Sym:
    """The score modifier as a graph over (score, b, h, q_idx, kv_idx, offset)."""
    g = graph
    g.torch_function = torch_function
    out = score_mod(
        g.leaf("score", FLOAT), g.leaf("b", INT), g.leaf("h", INT), g.leaf("q_idx", INT),
        g.leaf("kv_idx", INT), g.leaf("offset", INT),
    )
    out = g.lift(out)
    if not isinstance(out, Sym):
        raise CompileError("the score modifier returned a constant; it must return a score")
    return out._cast(FLOAT)
