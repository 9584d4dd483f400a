"""Sparse graph attention by gathering along the edges: cost ∝ edges·D, not Nq·Nk.

A ``GraphMask`` stores its edges target-major and sorted, so the edges of a run of target
nodes are one contiguous slice. Each slice of targets is one chunk:
- gather the query features of each edge's target and the key features and values of its
  source (rows of (B, N, H, D) tensors, so each gather reads contiguous memory);
- score each edge with the row-wise form of the similarity's kernel (``ROW_KERNELS``), then
  the score modifier with the edge's (target, source) indices;
- softmax over each target's edges (the chunk holds all of them, so no online rescaling);
- sum the weighted values per target.
The backward pass recomputes one chunk at a time, so memory stays O(chunk edges·H·D) per
worker beyond the O(N·D) inputs and outputs. Chunks are shared among torch's threads like
the tile engine's query blocks (``run_split``).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..masks import GraphMask
from ..similarity import ROW_KERNELS
from .tiles import TileSpec, run_split

# Gathering an edge costs about as much as this many dense tile entries (measured on CPU).
_GATHER_COST = 32
_CHUNK_EDGES = 1 << 13


def is_sparse(mask: GraphMask, nq: int, nk: int) -> bool:
    """Whether the gather path beats dense tiles for this graph."""
    return mask.num_edges * _GATHER_COST < nq * nk


def _edge_scores(spec: TileSpec, fq_e: Tensor, fk_e: Tensor, target: Tensor, source: Tensor):
    """Scores (B, E, H, 1) of edges whose features are (B, E, H, D)."""
    s = ROW_KERNELS[spec.kernel](fq_e, fk_e).unsqueeze(-1)
    if spec.scale is not None:
        scale = spec.scale
        if isinstance(scale, Tensor):  # (1, H, 1, 1) or () -> broadcast over (B, E, H, 1)
            scale = scale.reshape(-1, 1)
        s = s * scale
    if spec.score_mod is not None:
        b = torch.arange(spec.batch, device=s.device).view(-1, 1, 1, 1)
        h = torch.arange(spec.heads, device=s.device).view(1, 1, -1, 1)
        s = spec.score_mod(s, b, h, target.view(1, -1, 1, 1), source.view(1, -1, 1, 1), spec.offset)
        s = s.expand(fq_e.shape[0], fq_e.shape[1], spec.heads, 1).to(fq_e.dtype)
    return s


def _expand_heads(t: Tensor, heads: int) -> Tensor:
    """(B, E, Hkv, X) -> (B, E, H, X) without copying: query head h reads head h // (H/Hkv)."""
    b, e, hkv, x = t.shape
    return t.unsqueeze(3).expand(b, e, hkv, heads // hkv, x).reshape(b, e, heads, x)


def _chunk(spec, c: int, fq_e, fk_e, v_e, target, source, first, count):
    """Output (B, count, H, Dv) and lse (B, count, H, 1) of targets first ... first+count-1,
    from the features gathered along the chunk's edges: fq_e (B, E, H, D), fk_e (B, E, Hkv, D),
    v_e (B, E, Hkv, Dv)."""
    fk_e, v_e = _expand_heads(fk_e, spec.heads), _expand_heads(v_e, spec.heads)
    s = _edge_scores(spec, fq_e, fk_e, target, source)
    local = target - first
    shape = (s.shape[0], count, spec.heads, 1)
    index = local.view(1, -1, 1, 1).expand_as(s)
    row_max = s.new_full(shape, float("-inf")).scatter_reduce_(1, index, s.detach(), "amax")
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    p = torch.exp(s - row_max.index_select(1, local))
    row_sum = s.new_zeros(shape).index_add(1, local, p)
    weighted = p
    if spec.dropout_p > 0:  # chunk c's own generator: the backward pass redraws the same mask
        gen = torch.Generator(device=p.device).manual_seed(spec.seed + c)
        keep = torch.rand(p.shape, generator=gen, device=p.device) >= spec.dropout_p
        weighted = p * keep / (1.0 - spec.dropout_p)
    out = v_e.new_zeros(shape[:3] + (v_e.shape[-1],)).index_add(1, local, weighted * v_e)
    out = out / row_sum.masked_fill(row_sum == 0, 1.0)
    return out, row_max + row_sum.log()


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


def _gather(rows: Tensor, index: Tensor) -> Tensor:
    return rows.index_select(1, index)


def _grad_sums(fq_rows, fk_rows, v_rows, count):
    return [torch.zeros_like(t) for t in (fq_rows, fk_rows, v_rows)] + [None] * count


class _GraphAttention(torch.autograd.Function):
    """Forward chunk by chunk without a graph; the backward pass recomputes each chunk under
    a local autograd graph and scatters its gradients into one buffer per input and worker,
    so the total cost stays ∝ edges (a per-chunk autograd checkpoint would allocate a
    full-size gradient for every chunk)."""

    @staticmethod
    def forward(ctx, spec, graph, fq_rows, fk_rows, v_rows, *extras):
        target, source, chunks = graph
        shape = (fq_rows.shape[0], spec.nq, spec.heads)
        out = fq_rows.new_zeros(*shape, v_rows.shape[-1])
        lse = fq_rows.new_full((*shape, 1), float("-inf"))

        def rows(indices):
            with torch.no_grad():  # grad mode is per thread: workers start with it on
                for c in indices:
                    first, count, e0, e1 = chunks[c]
                    t, s = target[e0:e1], source[e0:e1]
                    out[:, first:first + count], lse[:, first:first + count] = _chunk(
                        spec, c, _gather(fq_rows, t), _gather(fk_rows, s), _gather(v_rows, s),
                        t, s, first, count)

        run_split(rows, chunks)
        ctx.spec, ctx.graph, ctx.extras = spec, graph, extras
        ctx.save_for_backward(fq_rows, fk_rows, v_rows)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        spec, (target, source, chunks) = ctx.spec, ctx.graph
        fq_rows, fk_rows, v_rows = ctx.saved_tensors
        wanted = [e for e in ctx.extras if e.requires_grad]

        @torch.no_grad()
        def rows(indices):
            sums = _grad_sums(fq_rows, fk_rows, v_rows, len(wanted))
            for c in indices:
                first, count, e0, e1 = chunks[c]
                t, s = target[e0:e1], source[e0:e1]
                with torch.enable_grad():
                    leaves = [_gather(fq_rows, t), _gather(fk_rows, s), _gather(v_rows, s)]
                    leaves = [x.requires_grad_() for x in leaves]
                    out, _ = _chunk(spec, c, *leaves, t, s, first, count)
                grads = torch.autograd.grad(
                    out, (*leaves, *wanted), dout[:, first:first + count], allow_unused=True
                )
                for buffer, index, g in zip(sums[:3], (t, s, s), grads[:3], strict=True):
                    buffer.index_add_(1, index, g)
                for e, g in enumerate(grads[3:], start=3):
                    if g is not None:
                        sums[e] = g if sums[e] is None else sums[e] + g
            return sums

        parts = run_split(rows, chunks)
        total = parts[0]
        for part in parts[1:]:
            total = [a if b is None else b if a is None else a + b
                     for a, b in zip(total, part, strict=True)]
        found = iter(total[3:])
        dextras = [next(found) if e.requires_grad else None for e in ctx.extras]
        return (None, None, *total[:3], *dextras)


def attention(spec: TileSpec, mask: GraphMask, fq, fk, v, extras) -> tuple[Tensor, Tensor]:
    """out (B, H, Nq, Dv) and lse (B, H, Nq, 1) along the graph's edges."""
    fq_rows, fk_rows, v_rows = (t.transpose(1, 2).contiguous() for t in (fq, fk, v))
    target, source = mask.target.to(fq.device), mask.source.to(fq.device)
    graph = (target, source, _chunks(target, spec.nq))
    out, lse = _GraphAttention.apply(spec, graph, fq_rows, fk_rows, v_rows, *extras)
    return out.transpose(1, 2), lse.transpose(1, 2)
