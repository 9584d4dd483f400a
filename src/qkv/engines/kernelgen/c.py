"""A similarity's pairwise term compiled to C tile loops from its own definition.

A term without C loops of its own (a user's ``qkv.Similarity``) is traced once per call
(``trace.trace_term``) into an expression graph over q_d, k_d and d. This module writes that
graph, its derivatives in q_d and k_d and in every tensor it reads (``derivative``),
into the same loops the built-in L1 has (``cpu_kernels.c``): the scores with keys innermost
on a transposed block held in cache, so the compiler vectorizes the term across keys; the
gradients across d, with a group of keys held while the queries stream past. The source is built
once per distinct term (``native.compile_library``, content-hashed) and loaded with ctypes.

The loops read the term's captured tensors (``Graph.slots``: shape () or (D,), float) and
return their gradients, so a learnable weight or temperature trains as with autograd. A term
that does not trace, or reads other tensors, has no loops here: the engine then evaluates it
with torch (``similarity.pairwise_sum``).
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import subprocess
import threading
import warnings

import torch
from torch import Tensor

from ..cpu import native
from . import c_vec, memo
from .c_emit import CEmitter
from .c_text import HEADER, TERM_EDGES, TERM_LOOPS, TERM_ROW, TRANSPOSE
from .derivative import depends_on, derivative, loads_in
from .graph import FLOAT, INT, MAX_SLOTS, CompileError, Graph, Sym
from .trace import TERM_ARGS, trace_term

_BLOCK = 64  # keys per transposed block, as in cpu_kernels.c
_C_TYPES = {torch.float32: ("float", "f"), torch.float64: ("double", "")}
_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64

_lock = threading.Lock()
_LIBRARIES: dict[str, object] = {}  # source digest -> its functions, or None


_PARAMS = "{T} pq, {T} pk, int64_t pd, " + ", ".join(f"const {{T}} *A{i}" for i in range(MAX_SLOTS))
_ARGS = "x, row[j], c, A0, A1, A2, A3"
_GARGS = "x, y, c, A0, A1, A2, A3"
_SLOT_ARGS = ", ".join([f"A{i}" for i in range(MAX_SLOTS)] + [f"G{i}" for i in range(MAX_SLOTS)])
_EARGS = "qr[c], kr[c], c, A0, A1, A2, A3"


def _function(name: str, root, ctype: str, fsuffix: str, kind: str = FLOAT,
              fma_sub: bool = False) -> str:
    e = CEmitter(ctype, fsuffix, fma_sub=fma_sub)
    result = e.ref(root) if root is not None else "0"
    rtype = ctype if kind == FLOAT else "int64_t"
    return "\n".join([f"static inline {rtype} {name}({_PARAMS.format(T=ctype)}) {{",
                      "    (void)pq; (void)pk; (void)pd;", *e.lines,
                      f"    return {result};", "}"])


def plain_values(*tensors: Tensor) -> bool:
    """Whether the tensors hold no NaN, infinity or -0 (``c_vec.halved_sign``): a min and max
    over each, then a look at the zeros, if any."""
    for t in tensors:
        t = t.detach()
        if t.numel() == 0:
            continue
        low, high = torch.aminmax(t)  # NaN anywhere makes both NaN
        if not (math.isfinite(low) and math.isfinite(high)):
            return False
        zeros = t == 0
        if zeros.any() and torch.signbit(t[zeros]).any():
            return False
    return True


def _source(root: Sym, dtype: torch.dtype, plain: bool | None = None) -> str:
    """The C loops of one traced term in one dtype; ``plain``: whether the q and k that the
    gradient loops will read hold only plain values (``plain_values``), which lets them
    write a sign in a shorter form (``c_vec.halved_sign``); None when they are not known."""
    ctype, fsuffix = _C_TYPES[dtype]
    graph = root.graph
    pq, pk = graph.leaf(TERM_ARGS[0], FLOAT), graph.leaf(TERM_ARGS[1], FLOAT)
    d_q, d_k = derivative(root, pq, {}), derivative(root, pk, {})
    parts = [HEADER, TRANSPOSE.format(T=ctype),
             _function("term", root, ctype, fsuffix, fma_sub=True),
             _function("term_dq", d_q, ctype, fsuffix),
             _function("term_dk", d_k, ctype, fsuffix)]
    decls = sums = updates = stores = tensor_stores = edge_updates = ""
    for n, load in enumerate(loads_in(root).values()):
        slot, *index = load.args
        d_load = derivative(root, load, {})
        if d_load is None or not graph.slots[slot].requires_grad:
            continue  # no sums: its gradient, never read, stays 0
        if any(depends_on(i, {pq.args[0], pk.args[0]}) for i in index):
            # Its sums are kept per lane of d, over many q and k values.
            raise CompileError("a tensor that needs a gradient is indexed by q or k values")
        parts.append(_function(f"term_d{n}", d_load, ctype, fsuffix))
        parts.append(_function(f"term_i{n}", index[0] if index else 0, ctype, fsuffix, INT))
        # A tensor's gradient sums every pair's contribution, with cancellation: in double.
        decls += f"\n        double total_{n}[LANES] = {{0}};"
        sums += f"\n            double sum_{n} = 0;"
        updates += f"\n                sum_{n} += (double)KEEP(gj * term_d{n}({_GARGS}));"
        stores += f"\n            total_{n}[l] += sum_{n};"
        tensor_stores += (f"\n        for (int64_t l = 0; l < lanes; l++) G{slot}[term_i{n}"
                          f"(0, 0, c0 + l, A0, A1, A2, A3)] += total_{n}[l] * scale;")
        edge_updates += (f"\n                    G{slot}[term_i{n}(qr[c], qr[c], c, A0, A1, A2, "
                         f"A3)] += (double)(gj * term_d{n}({_EARGS}));")
    slots = ", ".join(f"const {ctype} *A{i}" for i in range(MAX_SLOTS))
    grads = ", ".join(f"double *G{i}" for i in range(MAX_SLOTS))
    vector_groups = ""
    if not updates:  # the vector loops keep no tensor's gradient sums
        try:
            halved = c_vec.halved_sign(d_q, d_k) if plain else None
            functions, vector_groups = c_vec.vector_groups(
                d_q, d_k, graph.leaf(TERM_ARGS[2], INT), ctype, slots, halved)
            parts.append(functions)
        except CompileError:
            pass  # the scalar loops take all of d
    row = TERM_ROW.format(T=ctype, GARGS=_GARGS, SUMS=sums, UPDATES=updates, STORES=stores)
    parts.append(TERM_LOOPS.format(T=ctype, F=fsuffix, ARGS=_ARGS, CONST_SLOTS=slots,
                               GRAD_SLOTS=grads, SUM_DECLS=decls, SLOT_ARGS=_SLOT_ARGS,
                               SUM_STORES=tensor_stores, ROW=row, VECTOR_GROUPS=vector_groups))
    parts.append(TERM_EDGES.format(T=ctype, EARGS=_EARGS, CONST_SLOTS=slots, GRAD_SLOTS=grads,
                               EDGE_UPDATES=edge_updates))
    return "\n\n".join(parts)


_TERM_SIGNATURES = {
    "term_scores": [_PTR] * 3 + [_I64] * 6 + [_PTR, ctypes.c_double] + [_PTR] * MAX_SLOTS,
    "term_grads": [_PTR] * 5 + [_I64] * 8 + [ctypes.c_double] + [_PTR] * (2 * MAX_SLOTS),
    "term_edge_scores": [_PTR] * 5 + [_I64] * 7 + [_PTR] * MAX_SLOTS,
    "term_edge_grads": [_PTR] * 7 + [_I64] * 7 + [_PTR] * (2 * MAX_SLOTS),
}


def load_functions(source: str, stem: str, signatures: dict) -> tuple | None:
    """The C functions named in ``signatures`` (name -> argtypes) of generated ``source``,
    built once per distinct source; None when it does not build (with a warning)."""
    digest = hashlib.sha256(source.encode()).hexdigest()
    with _lock:
        if digest not in _LIBRARIES:
            try:
                lib = native.compile_library(source, stem)
            except (OSError, subprocess.SubprocessError) as err:
                detail = getattr(err, "stderr", b"") or err
                warnings.warn(f"qkv: generated C loops ({stem}) did not build ({detail!s}); "
                              "using torch operations", RuntimeWarning, stacklevel=4)
                lib = None
            functions = None
            if lib is not None:
                functions = tuple(getattr(lib, name) for name in signatures)
                for function, argtypes in zip(functions, signatures.values(), strict=True):
                    function.argtypes, function.restype = argtypes, None
            _LIBRARIES[digest] = functions
        return _LIBRARIES[digest]


_WARNED: set[tuple[str, int]] = set()


def warn_untraced(what: str, key, error: Exception) -> None:
    """Once per ``key``: ``what`` (a similarity term, a score modifier) runs on torch
    operations in tiles (exact, slower), not in C."""
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"qkv: {what} does not trace to C ({type(error).__name__}: {error}); "
                      "the fused engine runs it on torch operations in tiles instead, exact "
                      "but slower", RuntimeWarning, stacklevel=3)


_TRACES = memo.Traces()


def traced_loops(pair, dtype: torch.dtype, head_dim: int, scale: float = 1.0,
                 inputs: tuple[Tensor, Tensor] | None = None) -> native.TileLoops | None:
    """C loops for ``pair`` (a ``similarity.Pairwise`` without C loops of its own) in
    ``dtype`` with head dim ``head_dim``, traced from its term now or found traced
    (``memo``), reading the tensors the term captures as they are now; or None when it does
    not trace or nothing builds. The tile loops' scores and gradients are those of ``scale``
    times the term; the edge loops' are the term's (the graph engine scales each edge's
    score with its modifier). ``inputs``: the q and k (B, H, N, D) the tile gradient loops
    will read, when they are known (the backward pass); loops built for them must not be
    given others."""
    if dtype not in _C_TYPES or not native.available(dtype):
        return None
    keyed = memo.variant_key(pair.term)
    base = None if keyed is None else (keyed[0], dtype, head_dim)
    # A trace is kept with whether its gradient loops differ for inputs that hold only plain
    # values (``_reads_plain``): under plain None when they do not, so a backward whose term
    # has no such form makes no pass over q and k to find out (``plain_values``).
    found = None if base is None else _TRACES.lookup((*base, None), keyed[1], "cpu")
    if found is not None:
        (functions, reads_plain), slots = found
        if inputs is None or not reads_plain:
            return _loops(functions, tuple(slots), dtype, scale)
    plain = None if inputs is None else plain_values(*inputs)
    if base is not None and plain is not None:
        found = _TRACES.lookup((*base, plain), keyed[1], "cpu")
        if found is not None:
            (functions, _), slots = found
            return _loops(functions, tuple(slots), dtype, scale)
    graph = Graph("cpu", head_dim)
    try:
        root = trace_term(pair.term, graph)
    except Exception as e:  # noqa: BLE001  any term this tracer cannot follow runs in torch
        warn_untraced(f"similarity term {pair.name!r}", (pair.name, id(pair.term)), e)
        return None
    if not all(t.is_floating_point() and t.dim() <= 1 for t in graph.slots):
        return None
    reads_plain = _reads_plain(root)
    if not reads_plain:
        plain = None  # the same code either way: built and kept once
    try:
        source = _source(root, dtype, plain)
    except CompileError:
        return None
    functions = load_functions(source, "similarity_term", _TERM_SIGNATURES)
    if functions is None:
        return None
    if base is not None:
        _TRACES.store((*base, plain), keyed[1], (functions, reads_plain), graph)
    return _loops(functions, tuple(graph.slots), dtype, scale)


def _reads_plain(root: Sym) -> bool:
    """Whether the term's gradient loops take a shorter form for q and k that hold only plain
    values (``c_vec.halved_sign``), so that the backward checks its inputs."""
    pq, pk = root.graph.leaf(TERM_ARGS[0], FLOAT), root.graph.leaf(TERM_ARGS[1], FLOAT)
    return c_vec.halved_sign(derivative(root, pq, {}), derivative(root, pk, {})) is not None


def _loops(functions, slots: tuple[Tensor, ...], dtype: torch.dtype,
           scale: float) -> native.TileLoops:
    """The C functions bound to this call's slots (autograd sees these: their gradients flow
    to what they came from)."""
    values = [t.detach().to(dtype).contiguous() for t in slots]
    *loops, c_term = _bind(functions, values, dtype, scale)
    return native.TileLoops(*loops, tensors=slots, c_term=c_term)


def _bind(functions, values: list[Tensor], dtype: torch.dtype, scale: float = 1.0):
    """scores(q, k, out), add_grads(ds, q, k, dq, dk), edge_scores(q_rows, k_rows, target,
    source) and edge_grads(ds, q_rows, k_rows, target, source, dq, dk) over the C functions
    with the slot values, and ``TileLoops.c_term`` (its last item holds the memory the slot
    pointers point to) (see ``native.TileLoops``)."""
    scores_fn, grads_fn, edge_scores_fn, edge_grads_fn = functions
    dummy = torch.zeros(1, dtype=dtype)  # fills unused slots; the closure keeps values alive
    sink = torch.zeros(1, dtype=torch.float64)  # the same for unused gradient sums
    pointers = [v.data_ptr() for v in values] + [dummy.data_ptr()] * (MAX_SLOTS - len(values))

    def scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
        (q3, q_step), (k3, k_step) = native.rows_of(q), native.rows_of(k)
        nb, m, d = q3.shape
        n = k3.shape[1]
        if out is None:
            out = q.new_empty(nb, m, n)
        kt = q.new_empty(_BLOCK * d)
        scores_fn(q3.data_ptr(), k3.data_ptr(), out.data_ptr(), nb, m, n, d, q_step, k_step,
                  kt.data_ptr(), scale, *pointers)
        return out.view(*q.shape[:-1], n)

    def add_grads(ds: Tensor, q: Tensor, k: Tensor, dq: Tensor, dk: Tensor):
        (q3, q_step), (k3, k_step) = native.rows_of(q), native.rows_of(k)
        ds3 = ds.reshape(-1, ds.shape[-2], ds.shape[-1]).contiguous()
        nb, m, d = q3.shape
        n = k3.shape[1]
        sums = [torch.zeros(v.numel(), dtype=torch.float64) for v in values]
        sum_pointers = [s.data_ptr() for s in sums] + [sink.data_ptr()] * (MAX_SLOTS - len(sums))

        def add(dq_rows, dk_rows):
            grads_fn(ds3.data_ptr(), q3.data_ptr(), k3.data_ptr(), dq_rows[0].data_ptr(),
                     dk_rows[0].data_ptr(), nb, m, n, d, q_step, k_step, dq_rows[1],
                     dk_rows[1], scale, *pointers, *sum_pointers)

        native.add_rows_into(add, dq, dk)
        return tuple(s.view(v.shape) for s, v in zip(sums, values, strict=True))

    def edge_scores(q_rows: Tensor, k_rows: Tensor, target: Tensor, source: Tensor) -> Tensor:
        batch, nq, heads, d = q_rows.shape
        out = q_rows.new_empty(batch, target.numel(), heads)
        edge_scores_fn(q_rows.data_ptr(), k_rows.data_ptr(), target.data_ptr(),
                       source.data_ptr(), out.data_ptr(), batch, target.numel(), nq,
                       k_rows.shape[1], heads, k_rows.shape[2], d, *pointers)
        return out

    def edge_grads(ds, q_rows, k_rows, target, source, dq, dk):
        batch, nq, heads, d = q_rows.shape
        sums = [torch.zeros(v.numel(), dtype=torch.float64) for v in values]
        sum_pointers = [s.data_ptr() for s in sums] + [sink.data_ptr()] * (MAX_SLOTS - len(sums))
        edge_grads_fn(ds.data_ptr(), q_rows.data_ptr(), k_rows.data_ptr(), target.data_ptr(),
                      source.data_ptr(), dq.data_ptr(), dk.data_ptr(), batch, target.numel(), nq,
                      k_rows.shape[1], heads, k_rows.shape[2], d, *pointers, *sum_pointers)
        return tuple(s.view(v.shape) for s, v in zip(sums, values, strict=True))

    c_term = (native.address_of(scores_fn), native.address_of(grads_fn), pointers, scale,
              (values, dummy))
    return scores, add_grads, edge_scores, edge_grads, c_term
