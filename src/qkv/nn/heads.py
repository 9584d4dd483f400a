"""Attention's heads in and out of the feature axis: (B, N, H·D) <-> (B, H, N, D)."""

from __future__ import annotations

from torch import Tensor


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B, N, heads * D) -> (B, heads, N, D), a view."""
    b, n, _ = x.shape
    return x.view(b, n, heads, -1).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B, H, N, D) -> (B, N, H * D)."""
    return x.transpose(1, 2).flatten(2)
