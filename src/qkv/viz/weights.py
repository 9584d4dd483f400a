"""The attention weights of chosen heads, recomputed from the same definitions every engine
uses (similarity, score modifier, mask), without materializing the other heads.

The model's forward pass keeps its fast engine; this evaluates softmax rows for only the
heads a caller asked for. The head index the score modifier and the mask see is the original
one, so per-head ALiBi slopes, relative-bias tables and per-head masks stay right."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.problem import build_problem
from ..core.reference import accumulation_dtype, head_scores, masked_softmax


def check_heads(heads: Sequence[int] | int | None, n_head: int, where: str) -> list[int]:
    """None (all), one index or a sequence -> sorted unique indices in [0, n_head)."""
    if heads is None:
        return list(range(n_head))
    chosen = [heads] if isinstance(heads, int) else list(heads)
    if not chosen:
        raise ValueError(f"heads must name at least one head of {where}")
    for h in chosen:
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"head indices must be ints; got {h!r}")
        if not 0 <= h < n_head:
            raise ValueError(
                f"head index {h} is out of range for {where}: valid heads are 0..{n_head - 1}"
            )
    return sorted(set(chosen))


def head_weights(
    q: Tensor, k: Tensor, heads: Sequence[int], *, mask=None, score_mod=None,
    similarity: str = "dot", scale=None, metric: Tensor | None = None, lse: Tensor | None = None,
    rows: tuple[int, int] | None = None, weighting="softmax",
) -> Tensor:
    """The weights of ``heads`` only, under the call's weighting (softmax by default).

    Args:
        q: (B, H, Nq, D); k: (B, Hkv, Nk, D); mask, score_mod, similarity, scale, metric: as
            for ``qkv.attention``.
        heads: query-head indices in [0, H).
        lse: optional (B, H, Nq) or (B, H, Nq, 1) log-sum-exp an engine saved for this call
            (the fused engine keeps one); when given, the weights are exp(score - lse) and no
            row reduction is done.
        rows: (start, stop): only these query rows, so a long sequence's weights can be
            computed a block of rows at a time; masks and modifiers see the rows' own indices.
        weighting: the call's (``qkv.weighting``). Softmax reads ``lse``; the others compute
            each row from its own scores (the engines save no lse for them), so ``lse`` is
            not read.

    Returns:
        (B, len(heads), Nq, Nk) in q's dtype (Nq: stop - start with ``rows``), heads in
        ascending order; rows with no allowed key are 0.
    """
    # Validation and normalization are the dispatcher's own; k stands in for v (never read).
    p = build_problem(q, k, k, mask=mask, score_mod=score_mod, similarity=similarity,
                      scale=scale, metric=metric, dropout_p=0.0, return_weights=True,
                      weighting=weighting)
    chosen = check_heads(list(heads), p.heads, "this attention call")
    index = torch.tensor(chosen, device=q.device)
    acc = accumulation_dtype(q.dtype)
    start, stop = (0, p.nq) if rows is None else rows
    softmax = p.weighting.is_softmax
    scores, grid = head_scores(p, q, k, index, (start, stop), masked=softmax)
    qi, ki = grid[2], grid[3]
    if not softmax:
        allowed = (torch.ones((), dtype=torch.bool, device=q.device) if p.mask is None else
                   torch.as_tensor(p.mask.mask_mod(*grid, p.offset), device=q.device))
        weights = p.weighting.weights(scores, allowed.expand(scores.shape), qi.view(-1, 1)
                                      + p.offset, ki.view(1, -1), heads=grid[1])
        return weights.to(q.dtype)
    if lse is None:
        weights, _ = masked_softmax(scores)
    else:
        if lse.dim() == 3:
            lse = lse.unsqueeze(-1)
        if tuple(lse.shape) != (p.batch, p.heads, p.nq, 1):
            raise ValueError(f"lse must be (B, H, Nq) = {(p.batch, p.heads, p.nq)}; got "
                             f"{tuple(lse.shape)}")
        row_lse = lse.index_select(1, index)[:, :, start:stop].to(acc)
        finite = torch.isfinite(row_lse)
        weights = torch.where(finite, torch.exp(scores - torch.where(finite, row_lse, 0.0)), 0.0)
    return weights.to(q.dtype)
