"""Attention rollout (Abnar & Zuidema, 2020): how much each input token flows into each
position after a stack of layers, counting the residual connection as attention to oneself.

Per layer, heads are fused (mean by default) into A (B, N, N); the residual adds the identity,
Â = (1 - r)·A + r·I with r = ``residual`` (the paper's 0.5), and rows are re-normalized to sum
to 1. The rollout is the product Â_L ⋯ Â_1: row i says how much of position i after the last
layer comes from each input token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

HEAD_FUSIONS = ("mean", "max", "min")


def _fuse_heads(weights: Tensor, head_fusion: str) -> Tensor:
    """(B, H, N, N) -> (B, N, N)."""
    if head_fusion == "mean":
        return weights.mean(dim=1)
    if head_fusion == "max":
        return weights.amax(dim=1)
    return weights.amin(dim=1)


def _check_layers(layers: Sequence[Tensor]) -> None:
    if len(layers) == 0:
        raise ValueError("rollout needs the attention weights of at least one layer")
    for index, w in enumerate(layers):
        if not isinstance(w, Tensor) or w.dim() != 4 or w.shape[-1] != w.shape[-2]:
            shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(
                f"rollout: layer {index} weights must be self-attention (B, H, N, N); got {shape}"
            )
        if w.shape != layers[0].shape[:1] + w.shape[1:2] + layers[0].shape[2:]:
            raise ValueError(
                f"rollout: every layer must share B and N; layer 0 has {tuple(layers[0].shape)}, "
                f"layer {index} has {tuple(w.shape)}"
            )


def attention_rollout(
    layers: Sequence[Tensor], *, residual: float = 0.5, head_fusion: str = "mean"
) -> Tensor:
    """Roll out self-attention through a stack.

    Args:
        layers: the weights of each layer, first layer first, each (B, H, N, N) (any subset of
            heads; they are fused).
        residual: weight r of the identity in Â = (1 - r)·A + r·I, in [0, 1].
        head_fusion: "mean" (the paper's), "max" or "min" over heads.

    Returns:
        (B, N, N) float: row i is the share of each input token in position i at the top.
    """
    if head_fusion not in HEAD_FUSIONS:
        raise ValueError(f"head_fusion must be one of {HEAD_FUSIONS}; got {head_fusion!r}")
    if isinstance(residual, bool) or not isinstance(residual, (int, float)):
        raise TypeError(f"residual must be a number in [0, 1]; got {residual!r}")
    if not 0.0 <= residual <= 1.0:
        raise ValueError(f"residual must be in [0, 1]; got {residual}")
    _check_layers(layers)
    result = None
    for w in layers:
        result = rollout_step(result, w, residual=residual, head_fusion=head_fusion)
    return result


def rollout_step(result: Tensor | None, weights: Tensor, *, residual: float = 0.5,
                 head_fusion: str = "mean") -> Tensor:
    """One more layer: Â·result, with result (B, N, N) the rollout so far (None before the
    first layer) and weights (B, H, N, N) the next layer's. Lets a caller roll out layer by
    layer as maps are captured, holding one (N, N) product instead of every layer."""
    n = weights.shape[-1]
    dtype = torch.float64 if weights.dtype == torch.float64 else torch.float32
    eye = torch.eye(n, dtype=dtype, device=weights.device)
    a = (1.0 - residual) * _fuse_heads(weights.to(dtype), head_fusion) + residual * eye
    # Rows of padded or fully masked queries sum to r only; re-normalizing keeps rows stochastic
    # (the paper: "re-normalize the weights").
    a = a / a.sum(dim=-1, keepdim=True).clamp(min=torch.finfo(dtype).tiny)
    return a if result is None else a @ result.to(dtype)


def patch_relevance(rollout: Tensor, grid: tuple[int, int], *, cls_token: bool) -> Tensor:
    """What the ViT's output reads from each patch, as an image-shaped map.

    rollout (B, N, N) from ``attention_rollout``. With a class token (index 0, N = gh·gw + 1)
    the map is row 0 over the patches; with mean pooling (N = gh·gw) it is the mean of all rows.
    Returns (B, gh, gw), scaled so that each map's maximum is 1."""
    gh, gw = grid
    expected = gh * gw + (1 if cls_token else 0)
    if rollout.dim() != 3 or rollout.shape[-1] != expected:
        raise ValueError(
            f"patch_relevance: rollout must be (B, N, N) with N={expected} for a {gh}x{gw} grid"
            f"{' plus a class token' if cls_token else ''}; got {tuple(rollout.shape)}"
        )
    relevance = rollout[:, 0, 1:] if cls_token else rollout.mean(dim=1)
    relevance = relevance.reshape(-1, gh, gw)
    peak = relevance.flatten(1).amax(dim=1).clamp(min=torch.finfo(relevance.dtype).tiny)
    return relevance / peak.view(-1, 1, 1)
