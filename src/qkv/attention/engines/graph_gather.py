"""Sparse graph attention by gathering along the edges: cost ∝ edges·D, not Nq·Nk.

A ``GraphMask`` stores its edges target-major and sorted, so the edges of a run of target
nodes are one contiguous slice. Each slice of targets is one chunk:
- gather the query features of each edge's target and the key features and values of its
  source (rows of (B, N, H, D) tensors, so each gather reads contiguous memory);
- score each edge with the similarity's own pairwise kernel applied to 1×1 "matrices"
  (``KERNELS[kernel](q (…, 1, D), k (…, 1, D))``), then the score modifier with the edge's
  (target, source) indices;
- softmax over each target's edges (the chunk holds all of them, so no online rescaling);
- sum the weighted values per target.
Chunks run under activation checkpointing: the backward pass recomputes one chunk at a time,
so memory stays O(chunk edges·H·D) beyond the O(N·D) inputs and outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..masks import GraphMask
from ..similarity import KERNELS
from .tiles import TileSpec

# Gathering an edge costs about as much as this many dense tile entries (measured on CPU).
_GATHER_COST = 32
_CHUNK_EDGES = 1 << 13


def is_sparse(mask: GraphMask, nq: int, nk: int) -> bool:
    """Whether the gather path beats dense tiles for this graph."""
    return mask.num_edges * _GATHER_COST < nq * nk


def _edge_scores(spec: TileSpec, fq_e: Tensor, fk_e: Tensor, target: Tensor, source: Tensor):
    """Scores (B, E, H, 1) of edges whose features are (B, E, H, D)."""
    s = KERNELS[spec.kernel](fq_e.unsqueeze(-2), fk_e.unsqueeze(-2)).squeeze(-1)
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


def _chunk(spec, fq_rows, fk_rows, v_rows, target, source, first, count, *extras):
    """Output (B, count, H, Dv) and lse (B, count, H, 1) of targets first ... first+count-1."""
    fq_e = fq_rows.index_select(1, target)
    fk_e = _expand_heads(fk_rows.index_select(1, source), spec.heads)
    v_e = _expand_heads(v_rows.index_select(1, source), spec.heads)
    s = _edge_scores(spec, fq_e, fk_e, target, source)
    local = target - first
    shape = (s.shape[0], count, spec.heads, 1)
    index = local.view(1, -1, 1, 1).expand_as(s)
    row_max = s.new_full(shape, float("-inf")).scatter_reduce_(1, index, s.detach(), "amax")
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    p = torch.exp(s - row_max.index_select(1, local))
    row_sum = s.new_zeros(shape).index_add(1, local, p)
    weighted = F.dropout(p, spec.dropout_p) if spec.dropout_p > 0 else p
    out = v_e.new_zeros(shape[:3] + (v_e.shape[-1],)).index_add(1, local, weighted * v_e)
    out = out / row_sum.masked_fill(row_sum == 0, 1.0)
    return out, row_max + row_sum.log()


def attention(spec: TileSpec, mask: GraphMask, fq, fk, v, extras) -> tuple[Tensor, Tensor]:
    """out (B, H, Nq, Dv) and lse (B, H, Nq, 1) along the graph's edges."""
    fq_rows, fk_rows, v_rows = (t.transpose(1, 2).contiguous() for t in (fq, fk, v))
    target, source = mask.target.to(fq.device), mask.source.to(fq.device)
    row_start = torch.searchsorted(target, torch.arange(spec.nq + 1, device=fq.device)).tolist()
    grad = torch.is_grad_enabled() and any(
        t.requires_grad for t in (fq_rows, fk_rows, v_rows, *extras)
    )
    outs, lses, first = [], [], 0
    while first < spec.nq:
        last = first + 1  # grow the chunk of targets while its edges fit the budget
        while last < spec.nq and row_start[last + 1] - row_start[first] <= _CHUNK_EDGES:
            last += 1
        e0, e1 = row_start[first], row_start[last]
        args = (spec, fq_rows, fk_rows, v_rows, target[e0:e1], source[e0:e1], first, last - first)
        if grad:
            out, lse = checkpoint(_chunk, *args, *extras, use_reentrant=False)
        else:
            out, lse = _chunk(*args)
        outs.append(out)
        lses.append(lse)
        first = last
    out = torch.cat(outs, 1).transpose(1, 2)
    lse = torch.cat(lses, 1).transpose(1, 2).detach()
    return out, lse
