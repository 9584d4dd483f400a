"""The materialized reference: the source of truth every engine is checked against.

It evaluates the single definitions of similarity, score modifier and mask on the full
(B, H, Nq, Nk) score matrix, in float64 for float64 inputs and float32 otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import index_grid
from .problem import Problem
from .result import Result
from .scores import modified_scores


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax and sums run in float64 for float64 inputs and in float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_softmax(scores: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over the last dim where -inf marks a forbidden key.

    Returns (weights, lse). A row with no allowed key gets weights 0 and lse -inf, with zero
    gradients through both, never NaN."""
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max)).detach()
    exp = torch.exp(scores - row_max)
    denom = exp.sum(dim=-1, keepdim=True)
    empty = denom == 0
    safe = torch.where(empty, torch.ones_like(denom), denom)
    weights = exp / safe
    lse = torch.where(empty, float("-inf"), row_max + torch.log(safe)).squeeze(-1)
    return weights, lse


def expand_kv_heads(t: Tensor, heads: int) -> Tensor:
    """(B, Hkv, N, D) -> (B, H, N, D): query head h reads key/value head h // (H / Hkv)."""
    return t if t.shape[1] == heads else t.repeat_interleave(heads // t.shape[1], dim=1)


def scores_of(p: Problem, q: Tensor, k: Tensor, masked: bool = True) -> Tensor:
    """Modified scores (B, H, Nq, Nk) in q's dtype; with ``masked``, forbidden entries are
    -inf."""
    scale = p.scale_tensor()
    if isinstance(scale, Tensor):
        scale = scale.to(q.dtype)
    metric = None if p.metric is None else p.metric.to(q.dtype)
    raw = p.similarity.raw_scores(q, expand_kv_heads(k, p.heads), metric)
    index = index_grid(p.batch, p.heads, p.nq, p.nk, q.device)
    return modified_scores(raw, index, p.offset, scale=scale, score_mod=p.score_mod,
                           mask=p.mask if masked else None)


def head_scores(p: Problem, q: Tensor, k: Tensor, index: Tensor, rows: tuple[int, int], *,
                masked: bool = True, inplace: bool = False) -> tuple[Tensor, tuple]:
    """Modified scores (B, len(index), stop - start, Nk) of query heads ``index`` (a long
    tensor) and rows ``(start, stop)`` only, in the accumulation dtype, with the index grid
    (b, h, q_idx, kv_idx) they were modified on: the chosen heads and rows keep their own
    indices, so per-head modifiers and masks stay right. With ``masked``, forbidden entries
    are -inf; ``inplace`` scales and masks the raw scores' memory (no gradient is wanted)."""
    acc = accumulation_dtype(q.dtype)
    start, stop = rows
    q_sel = q.index_select(1, index)[:, :, start:stop].to(acc)
    k_sel = k.index_select(1, index // (p.heads // p.kv_heads)).to(acc)
    scale = p.scale
    if isinstance(scale, Tensor):
        scale = scale.to(acc)
        if scale.dim() == 1:
            scale = scale.index_select(0, index).view(1, -1, 1, 1)
    metric = p.metric
    if metric is not None:
        metric = metric.to(acc)
        if metric.dim() == 3:
            metric = metric.index_select(0, index)
    raw = p.similarity.raw_scores(q_sel, k_sel, metric)
    b, _, _, ki = index_grid(p.batch, 1, 1, p.nk, q.device)
    qi = torch.arange(start, stop, device=q.device).view(1, 1, -1, 1)
    grid = (b, index.view(1, -1, 1, 1), qi, ki)
    return modified_scores(raw, grid, p.offset, scale=scale, score_mod=p.score_mod,
                           mask=p.mask if masked else None, inplace=inplace), grid


def weighted(p: Problem, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """The weights (B, H, Nq, Nk) of ``p``'s weighting and the lse (B, H, Nq): softmax's, or
    zeros for a weighting without one. A weighting other than softmax reads the scores
    without the mask and gives 0 where the mask forbids."""
    if p.weighting.is_softmax:
        return masked_softmax(scores_of(p, q, k))
    s = scores_of(p, q, k, masked=False)
    allowed = (torch.ones((), dtype=torch.bool, device=q.device) if p.mask is None else
               p.mask.materialize(p.batch, p.heads, p.nq, p.nk, q.device))
    pos_q = torch.arange(p.nq, device=q.device).view(-1, 1) + p.offset
    kv_idx = torch.arange(p.nk, device=q.device).view(1, -1)
    weights = p.weighting.weights(s, allowed.expand(s.shape), pos_q, kv_idx)
    return weights, q.new_zeros(p.batch, p.heads, p.nq)


def reference_attention(p: Problem) -> tuple[Tensor, Tensor, Tensor]:
    """Returns out (B, H, Nq, Dv) and weights (B, H, Nq, Nk) in q's dtype, and lse (B, H, Nq)
    in the accumulation dtype."""
    acc = accumulation_dtype(p.q.dtype)
    q, k, v = (t.to(acc) for t in (p.q, p.k, p.v))
    weights, lse = weighted(p, q, k)
    if p.dropout_p > 0:
        weights = F.dropout(weights, p.dropout_p)
    out = weights @ expand_kv_heads(v, p.heads)
    return out.to(p.q.dtype), weights.to(p.q.dtype), lse


def plan(p: Problem):
    """The reference runs every request."""

    def run() -> Result:
        out, weights, lse = reference_attention(p)
        return Result(out, lse, weights if p.return_weights else None)

    return run
