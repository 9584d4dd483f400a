"""The graph engine: sparse graph attention along the edges, cost ∝ edges·D, not Nq·Nk.

It runs a ``qkv.graph`` mask sparse enough that gathering rows per edge beats dense tiles
(``is_sparse``), with the fused CPU engine's features and tile spec.

A ``GraphMask`` stores its edges target-major and sorted, so the edges of a run of target
nodes are one contiguous slice. Each slice of targets is one chunk:
- score each edge with the similarity's kernel on its target's query row and its source's
  key row, then apply the scale and score modifier with the edge's (target, source) indices;
- softmax over each target's edges (the chunk holds all of them, so no online rescaling),
  or, for an elementwise weighting (``Carry.NONE``), the modified scores as the weights;
- add the weighted value rows into each target's output row.
The backward pass recomputes one chunk at a time: only the elementwise part (scale,
modifier) runs under autograd, and the kernel's and the values' gradients are scattered
along the edges by hand, like the tile engine's.

Three edge primitives do the O(edges·D) work: ``scores``, ``scatter`` and ``kernel_grads``.
They run in C, reading rows in place: the built-in terms by their kind (``terms.TermKind``),
a user's term in loops generated from it (``kernelgen.c``, which also return the
gradients of the tensors it reads). Without a C library, or for a term that does not trace,
they run in torch by gathering rows per edge and evaluating the term's own definition
(``Pairwise.rows``), differentiated by autograd. Chunks are shared among torch's
threads like the tile engine's query blocks (``workers.run_queued``; the backward's in
``workers.run_in_chains``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.masks import GraphMask
from ...core.result import Result
from ...core.scores import modified_scores
from ...core.similarity import DOT
from ...core.weighting import Carry
from .. import ops
from ..kernelgen import c as c_target
from ..lowering import TermKind, lower, term_kind
from . import native
from .tiles import (
    TileSpec,
    add_grads,
    cpu_why_not,
    draw_seed,
    dropout_keep,
    elementwise_needs_grad,
    extra_tensors,
    grad_sums,
    tile_spec,
)
from .workers import run_in_chains, run_queued, sum_chains

# Gathering an edge costs about as much as this many dense tile entries (measured on CPU).
_GATHER_COST = 32
_CHUNK_EDGES = 1 << 13


def is_sparse(mask: GraphMask, nq: int, nk: int) -> bool:
    """Whether the gather path beats dense tiles for this graph."""
    return mask.num_edges * _GATHER_COST < nq * nk


def _gather_heads(rows: Tensor, index: Tensor, heads: int) -> Tensor:
    """(B, N, Hx, d) rows at ``index`` -> (B, E, H, d): head h reads row head h // (H/Hx)."""
    x = rows.index_select(1, index)
    b, e, hx, d = x.shape
    return x.unsqueeze(3).expand(b, e, hx, heads // hx, d).reshape(b, e, heads, d)


def _fold_heads(x: Tensor, heads: int) -> Tensor:
    """(B, E, H, d) -> (B, E, heads, d), summing the query heads that share a row head."""
    b, e, h, d = x.shape
    return x.view(b, e, heads, h // heads, d).sum(3)


def _gathered(q_rows, k_rows, target, source) -> tuple[Tensor, Tensor]:
    """Each edge's query and key rows (B, E, H, d)."""
    return q_rows.index_select(1, target), _gather_heads(k_rows, source, q_rows.shape[2])


def _scores(spec, q_rows, k_rows, target, source) -> Tensor:
    """(B, E, H): the pairwise term of each edge."""
    if native.edge_loops(spec.pair, q_rows.dtype):
        return native.edge_scores(term_kind(spec.pair), q_rows, k_rows, target, source)
    if spec.loops is not None:
        return spec.loops.edge_scores(q_rows, k_rows, target, source)
    return spec.pair.rows(*_gathered(q_rows, k_rows, target, source))


def _dot_rows(q_rows, k_rows, target, source) -> Tensor:
    """(B, E, H): q·k of each edge's rows (the backward's dout·v)."""
    if native.edge_loops(DOT, q_rows.dtype):
        return native.edge_scores(TermKind.DOT, q_rows, k_rows, target, source)
    return DOT.rows(*_gathered(q_rows, k_rows, target, source))


def _scatter(weights, x_rows, frm, to, out) -> None:
    if native.available(weights.dtype):
        return native.edge_scatter(weights, x_rows, frm, to, out)
    x = _gather_heads(x_rows, frm, weights.shape[2])
    out.index_add_(1, to, _fold_heads(weights.unsqueeze(-1) * x, out.shape[2]))


def _add_term_grads(spec, ds, q_rows, k_rows, target, source, sums, wanted) -> None:
    """sums[0][:, target] += ds·∂term/∂q, sums[1][:, source] += ds·∂term/∂k, and the term's
    tensors' gradients into their sums, for ds (B, E, H) = d(loss)/d(edge terms)."""
    if native.edge_loops(spec.pair, ds.dtype):
        native.edge_kernel_grads(term_kind(spec.pair), ds, q_rows, k_rows, target, source,
                                 sums[0], sums[1])
        return
    if spec.loops is not None:
        grads = spec.loops.edge_grads(ds, q_rows, k_rows, target, source, sums[0], sums[1])
        for tensor, grad in zip(spec.loops.tensors, grads, strict=True):
            for i, w in enumerate(wanted):
                if w is tensor:
                    add_grads(sums, 3 + i, [grad])  # float64 sums; cast once at the end
        return
    tensors = [t for t in spec.pair.tensors() if any(t is w for w in wanted)]
    with torch.enable_grad():
        qe, ke = (t.detach().requires_grad_() for t in _gathered(q_rows, k_rows, target, source))
        found = torch.autograd.grad(spec.pair.rows(qe, ke), (qe, ke, *tensors), ds,
                                    allow_unused=True)
    sums[0].index_add_(1, target, found[0])
    sums[1].index_add_(1, source, _fold_heads(found[1], sums[1].shape[2]))
    positions = [next(i for i, w in enumerate(wanted) if w is t) for t in tensors]
    for i, g in zip(positions, found[2:], strict=True):
        add_grads(sums, 3 + i, [g])


def _modify(spec: TileSpec, raw: Tensor, target: Tensor, source: Tensor) -> Tensor:
    """``scores.modified_scores`` of edge scores raw (B, E, H, 1): each edge's (target,
    source) pair are its query and key indices; the edges are the mask."""
    scale = spec.scale
    if isinstance(scale, Tensor):  # (1, H, 1, 1) or () -> broadcast over (B, E, H, 1)
        scale = scale.reshape(-1, 1)
    b = torch.arange(spec.batch, device=raw.device).view(-1, 1, 1, 1)
    h = torch.arange(spec.heads, device=raw.device).view(1, 1, -1, 1)
    index = (b, h, target.view(1, -1, 1, 1), source.view(1, -1, 1, 1))
    return modified_scores(raw, index, spec.offset, scale=scale, score_mod=spec.score_mod)


def _chunks(target: Tensor, nq: int) -> list[tuple[int, int, int, int]]:
    """(first target, target count, first edge, end edge) of chunks of about _CHUNK_EDGES."""
    row_start = torch.searchsorted(target, torch.arange(nq + 1, device=target.device)).tolist()
    chunks, first = [], 0
    while first < nq:
        last = first + 1  # grow the chunk of targets while its edges fit the budget
        while last < nq and row_start[last + 1] - row_start[first] <= _CHUNK_EDGES:
            last += 1
        chunks.append((first, last - first, row_start[first], row_start[last]))
        first = last
    return chunks


def _forward_chunk(spec, c, chunk, graph, rows, out, lse) -> None:
    """Writes out and lse rows of the chunk's targets (out's rows start at zero)."""
    target, source, _ = graph
    fq_rows, fk_rows, v_rows = rows
    first, count, e0, e1 = chunk
    t, s = target[e0:e1], source[e0:e1]
    scores = _modify(spec, _scores(spec, fq_rows, fk_rows, t, s).unsqueeze(-1), t, s)
    softmax = spec.variant.is_softmax
    if softmax:
        local = t - first
        shape = (scores.shape[0], count, spec.heads, 1)
        index = local.view(1, -1, 1, 1).expand_as(scores)
        row_max = scores.new_full(shape, float("-inf")).scatter_reduce_(1, index, scores, "amax")
        row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
        p = torch.exp(scores - row_max.index_select(1, local))
        row_sum = scores.new_zeros(shape).index_add_(1, local, p)
    else:  # an elementwise weighting: its function ended the modifier, the scores are weights
        p = scores
    if spec.dropout_p > 0:
        # Chunk c's keep mask from its own generator: the backward pass redraws the same one.
        p = p * dropout_keep(spec, c, 0, p.shape, p.device) / (1.0 - spec.dropout_p)
    _scatter(p.squeeze(-1).contiguous(), v_rows, s, t, out)
    if softmax:
        out[:, first:first + count] /= row_sum.masked_fill(row_sum == 0, 1.0)
        lse[:, first:first + count] = row_max + row_sum.log()


def _backward_chunk(spec, c, chunk, graph, saved, wanted, sums) -> None:
    """Adds the chunk's gradients into sums [dq, dk, dv, *wanted] (dq, dk, dv row layout)."""
    target, source, _ = graph
    fq_rows, fk_rows, v_rows, lse, dout, delta = saved
    first, count, e0, e1 = chunk
    t, s = target[e0:e1], source[e0:e1]
    raw = _scores(spec, fq_rows, fk_rows, t, s).unsqueeze(-1)
    graph_needed = elementwise_needs_grad(spec)
    if graph_needed:
        raw.requires_grad_()
        with torch.enable_grad():
            scores = _modify(spec, raw, t, s)
    else:
        scores = _modify(spec, raw, t, s)
    softmax = spec.variant.is_softmax
    p = torch.exp(scores.detach() - lse.index_select(1, t)) if softmax else scores.detach()
    dp = _dot_rows(dout, v_rows, t, s).unsqueeze(-1)
    kept = p
    if spec.dropout_p > 0:
        keep = dropout_keep(spec, c, 0, p.shape, p.device) / (1.0 - spec.dropout_p)
        kept, dp = p * keep, dp * keep
    _scatter(kept.squeeze(-1).contiguous(), dout, t, s, sums[2])
    ds = p * (dp - delta.index_select(1, t)) if softmax else dp
    if graph_needed:
        if not scores.requires_grad:  # a modifier that ignores the score and reads no tensor
            return
        found = torch.autograd.grad(scores, (raw, *wanted), ds, allow_unused=True)
        add_grads(sums, 3, found[1:])
        ds = found[0]
        if ds is None:  # a modifier that ignores the score: no gradient reaches q or k
            return
    elif spec.scale is not None:
        ds = ds * spec.scale
    _add_term_grads(spec, ds.squeeze(-1).contiguous(), fq_rows, fk_rows, t, s, sums, wanted)


def _chunk_edges(chunk: tuple[int, int, int, int]) -> int:
    """A chunk's work for ``run_queued`` and ``run_in_chains``: its edges."""
    return chunk[3] - chunk[2]


def _forward(spec, graph, fq_rows, fk_rows, v_rows) -> tuple[Tensor, Tensor]:
    """out (B, Nq, H, Dv) and lse (B, Nq, H, 1), chunk by chunk without a graph."""
    chunks = graph[2]
    shape = (fq_rows.shape[0], spec.nq, spec.heads)
    out = fq_rows.new_zeros(*shape, v_rows.shape[-1])
    lse = fq_rows.new_full((*shape, 1), float("-inf"))

    def work(indices):
        with torch.no_grad():  # grad mode is per thread: workers start with it on
            for c in indices:
                _forward_chunk(spec, c, chunks[c], graph, (fq_rows, fk_rows, v_rows), out, lse)

    run_queued(work, chunks, _chunk_edges)  # each chunk writes its own rows
    return out, lse


def _backward(spec, graph, fq_rows, fk_rows, v_rows, out, lse, dout, dlse, wanted):
    """Recompute each chunk and scatter its gradients into one buffer per input and chain:
    [dq, dk, dv] (row layout) and the gradients of ``wanted``."""
    delta = (dout * out).sum(-1, keepdim=True)
    if dlse is not None:  # d lse / d score = p: it joins the softmax's gradient
        delta = delta - dlse
    # Targets with no allowed edge: +inf makes exp(score - lse) exactly 0.
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    saved = (fq_rows, fk_rows, v_rows, lse, dout, delta)

    def chunk(c, sums, _):
        _backward_chunk(spec, c, graph[2][c], graph, saved, wanted, sums)

    sums = run_in_chains(
        chunk, graph[2], _chunk_edges,
        start_chain=lambda: grad_sums((fq_rows, fk_rows, v_rows), len(wanted)),
        start_worker=lambda: None,
        chain_bytes=sum(t.numel() * t.element_size() for t in (fq_rows, fk_rows, v_rows)))
    return sum_chains(sums, buffers=3)


def _rows_of(t: Tensor) -> Tensor:
    return t.transpose(1, 2).contiguous()


def _prepare(fq, fk, variant, dropout_p, seed):
    pair = variant.pair
    # A user's term runs in C loops generated from it (``kernelgen.c``) when it traces.
    loops = (None if term_kind(pair) is not TermKind.TRACED
             else c_target.traced_loops(pair, fq.dtype, fq.shape[-1]))
    spec = tile_spec(fq, fk, variant, dropout_p, seed, loops)
    target, source = variant.mask.target.to(fq.device), variant.mask.source.to(fq.device)
    return spec, (target, source, _chunks(target, spec.nq))


def _kernel_forward(fq, fk, v, variant, dropout_p, want_weights):
    seed = draw_seed(dropout_p)
    spec, graph = _prepare(fq, fk, variant, dropout_p, seed)
    out, lse = _forward(spec, graph, *(_rows_of(t) for t in (fq, fk, v)))
    return out.transpose(1, 2), lse.transpose(1, 2), None, seed


def _kernel_backward(dout, dlse, fq, fk, v, out, lse, seed, variant, dropout_p, wanted):
    with torch.enable_grad():  # what the tracer derives from a wanted tensor keeps its graph
        spec, graph = _prepare(fq, fk, variant, dropout_p, seed)
    extras = extra_tensors(spec, wanted)
    rows = [_rows_of(t) for t in (fq, fk, v, out, lse, dout)]
    dlse = None if dlse is None else _rows_of(dlse)
    dq, dk, dv, *dextras = _backward(spec, graph, *rows, dlse, extras)
    grads = ops.grads_of_wanted(wanted, extras, dextras)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), grads


KERNELS = ops.EngineKernels(
    _kernel_forward, _kernel_backward,
    lse_like=lambda fq: fq.new_empty(*fq.shape[:3], 1),
)
OP = ops.define("graph", KERNELS)


def why_not(p) -> str | None:
    reason = cpu_why_not(p)
    if reason is not None:
        return reason
    if not isinstance(p.mask, GraphMask):
        return "the graph engine runs qkv.graph masks"
    if not (p.weighting.is_softmax or p.weighting.carry is Carry.NONE):
        return (f"the graph engine's edges run softmax and the elementwise weightings, not "
                f"the weighting {p.weighting!r}, whose row statistic it does not carry")
    if not is_sparse(p.mask, p.nq, p.nk):
        return "the graph has too many edges: dense tiles are faster"
    if p.return_weights:
        return "the graph engine does not return weights (the fused engine does)"
    return None


def run(p) -> Result:
    fq, fk, v, variant = lower(p)
    out, lse, _ = OP.run(fq, fk, v, variant, p.dropout_p, False)
    return Result(out.to(p.q.dtype), lse.squeeze(-1))
