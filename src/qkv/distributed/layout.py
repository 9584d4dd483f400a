"""Which global positions each rank holds: the contiguous and zigzag layouts.

``contiguous``: rank r holds piece r of P equal pieces.
``zigzag``: the sequence is cut into 2P pieces and rank r holds pieces r and 2P-1-r, so that
under a causal mask every rank has the same amount of work (an early piece and a late one).
"""

from __future__ import annotations

import torch
from torch import Tensor

LAYOUTS = ("contiguous", "zigzag")


def pieces_per_rank(layout: str) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return 1 if layout == "contiguous" else 2


def chunks(layout: str, rank: int, world: int, n_local: int) -> list[tuple[int, int, int]]:
    """The contiguous runs of a rank's shard of ``n_local`` positions:
    (local start, global start, length) each."""
    if pieces_per_rank(layout) == 1:
        return [(0, rank * n_local, n_local)]
    half = n_local // 2
    return [(0, rank * half, half), (half, (2 * world - 1 - rank) * half, half)]


def shard(x: Tensor, rank: int, world: int, layout: str = "contiguous", dim: int = 2) -> Tensor:
    """Rank ``rank``'s shard of a whole sequence ``x`` along ``dim`` (q, k, v: dim 2; token
    ids (B, N): dim 1). N must divide into P pieces (zigzag: 2P)."""
    pieces = world * pieces_per_rank(layout)
    n = x.shape[dim]
    if n % pieces:
        raise ValueError(f"context parallel: the sequence length {n} must be divisible by "
                         f"{pieces} ({layout} layout over {world} ranks)")
    parts = x.chunk(pieces, dim)
    if layout == "contiguous":
        return parts[rank]
    return torch.cat([parts[rank], parts[pieces - 1 - rank]], dim)


def unshard(shards: list[Tensor], layout: str = "contiguous", dim: int = 2) -> Tensor:
    """The whole sequence from every rank's shard, in rank order (the inverse of ``shard``)."""
    if pieces_per_rank(layout) == 1:
        return torch.cat(shards, dim)
    firsts, seconds = zip(*(s.chunk(2, dim) for s in shards), strict=True)
    return torch.cat(list(firsts) + list(reversed(seconds)), dim)


def positions(n_global: int, rank: int, world: int, layout: str = "contiguous",
              device=None) -> Tensor:
    """(N/P,) the global positions of rank ``rank``'s shard (for RoPE and position tables)."""
    return shard(torch.arange(n_global, device=device), rank, world, layout, dim=0)
