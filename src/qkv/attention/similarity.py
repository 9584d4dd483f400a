"""Similarities: how a query and a key are compared before the softmax.

Each similarity is written once, as two parts that every engine shares:
- ``features(q, k, metric)``: an O(N·D) map of q and k (identity, unit-normalize, or the
  Mahalanobis transform q -> qLᵀ);
- ``kernel``: one of three pairwise forms an engine must fuse on tiles:
  ``"dot"`` (q·k), ``"neg_sqdist"`` (-‖q-k‖²) or ``"neg_l1"`` (-‖q-k‖₁).
The score is ``scale * kernel(features(q), features(k))``.

Each kernel also has a row-wise form (``ROW_KERNELS``: one score per pair of matching rows,
the diagonal of the pairwise form) for engines that gather (q, k) pairs along graph edges.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def dot_scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
    """(..., Nq, D), (..., Nk, D) -> (..., Nq, Nk): q·k. Each kernel writes into ``out``
    (contiguous, of the result's shape) when given: engines reuse one buffer per worker."""
    return torch.matmul(q, k.transpose(-1, -2), out=out)


def neg_sqdist_scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
    """-‖q-k‖² by the norm expansion 2q·k - ‖q‖² - ‖k‖² (the form fused engines use), as one
    matrix product of augmented vectors [q, ‖q‖², 1]·[2k, -1, -‖k‖²]: a single pass over the
    (Nq, Nk) scores instead of four."""
    ones_q, ones_k = torch.ones_like(q[..., :1]), torch.ones_like(k[..., :1])
    qa = torch.cat([q, (q * q).sum(-1, keepdim=True), ones_q], dim=-1)
    ka = torch.cat([2 * k, -ones_k, -(k * k).sum(-1, keepdim=True)], dim=-1)
    scores = dot_scores(qa, ka, out)
    return scores.clamp(max=0) if out is None else scores.clamp_(max=0)


def neg_l1_scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
    """-‖q-k‖₁. No matrix-multiply form exists; cdist sums |q-k| without materializing the
    (..., Nq, Nk, D) differences (about 10x faster than broadcasting, forward and backward)."""
    return torch.neg(torch.cdist(q, k, p=1), out=out)


KERNELS: dict[str, Callable[..., Tensor]] = {
    "dot": dot_scores,
    "neg_sqdist": neg_sqdist_scores,
    "neg_l1": neg_l1_scores,
}


def dot_rows(q: Tensor, k: Tensor) -> Tensor:
    """(..., D), (..., D) -> (...): q·k of matching rows."""
    return (q * k).sum(-1)


def neg_sqdist_rows(q: Tensor, k: Tensor) -> Tensor:
    """-‖q-k‖² of matching rows, from the difference (exact; no expansion needed per pair)."""
    return -(q - k).square().sum(-1)


def neg_l1_rows(q: Tensor, k: Tensor) -> Tensor:
    """-‖q-k‖₁ of matching rows."""
    return -(q - k).abs().sum(-1)


ROW_KERNELS: dict[str, Callable[..., Tensor]] = {
    "dot": dot_rows,
    "neg_sqdist": neg_sqdist_rows,
    "neg_l1": neg_l1_rows,
}


def _identity(q: Tensor, k: Tensor, metric: Tensor | None) -> tuple[Tensor, Tensor]:
    return q, k


def _unit(q: Tensor, k: Tensor, metric: Tensor | None) -> tuple[Tensor, Tensor]:
    return F.normalize(q, dim=-1, eps=1e-12), F.normalize(k, dim=-1, eps=1e-12)


def _mahalanobis(q: Tensor, k: Tensor, metric: Tensor | None) -> tuple[Tensor, Tensor]:
    """q -> q Lᵀ and k -> k Lᵀ, so that ‖L(q-k)‖² = ‖qLᵀ - kLᵀ‖². A per-head metric (H, D, D)
    needs k per query head, so grouped k heads are expanded first."""
    assert metric is not None
    metric = metric.to(q.dtype)
    if metric.dim() == 2:
        return q @ metric.T, k @ metric.T
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    lt = metric.transpose(-1, -2).unsqueeze(0)  # (1, H, D, D)
    return q @ lt, k @ lt


def _inv_sqrt_d(d: int) -> float:
    return 1.0 / math.sqrt(d)


def _sqrt_d(d: int) -> float:
    return math.sqrt(d)


@dataclass(frozen=True)
class Similarity:
    """One similarity: a feature map, a pairwise kernel, a sign convention and a default scale."""

    name: str
    features: Callable[[Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor]]
    kernel: str
    default_scale: Callable[[int], float]
    needs_metric: bool = False

    def scores(self, q: Tensor, k: Tensor, scale, metric: Tensor | None = None) -> Tensor:
        """Scores (B, H, Nq, Nk) for q (B, H, Nq, D) and k (B, H, Nk, D) (heads already matched)."""
        fq, fk = self.features(q, k, metric)
        return scale * KERNELS[self.kernel](fq, fk)


SIMILARITIES: dict[str, Similarity] = {
    s.name: s
    for s in (
        Similarity("dot", _identity, "dot", _inv_sqrt_d),
        # Unit vectors give scores in [-1, 1]; scale √D restores the spread that q·k/√D has for
        # unit-variance q and k, so a model can swap dot for cosine without retuning.
        Similarity("cosine", _unit, "dot", _sqrt_d),
        Similarity("l2", _identity, "neg_sqdist", _inv_sqrt_d),
        Similarity("l1", _identity, "neg_l1", _inv_sqrt_d),
        Similarity("mahalanobis", _mahalanobis, "neg_sqdist", _inv_sqrt_d, needs_metric=True),
    )
}


def get_similarity(name) -> Similarity:
    if isinstance(name, Similarity):
        return name
    if name not in SIMILARITIES:
        raise ValueError(
            f"similarity must be one of {', '.join(repr(n) for n in SIMILARITIES)}; got {name!r}"
        )
    return SIMILARITIES[name]
