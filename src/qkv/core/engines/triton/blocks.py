"""Block tables from a mask's tile classification (FlexAttention's BlockMask, in one tensor).

A row table (B|1, H|1, QB, 2 + KB) int32 lists, per query tile: the number of PARTIAL key
tiles, the number of FULL key tiles, then their indices (partial first, then full, each in
ascending order). A column table (B|1, H|1, KB, 2 + QB) lists query tiles per key tile, for
the dK/dV kernel. EMPTY tiles are never listed, so the kernels never visit them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...masks import EMPTY, FULL, PARTIAL, Mask


def classify(mask: Mask | None, batch: int, heads: int, nq: int, nk: int, block_m: int,
             block_n: int, device) -> Tensor:
    """uint8 (B|1, H|1, ceil(Nq/block_m), ceil(Nk/block_n)) tile states; no mask is all FULL."""
    if mask is None:
        shape = (1, 1, -(-nq // block_m), -(-nk // block_n))
        return torch.full(shape, FULL, dtype=torch.uint8, device=device)
    return mask.tile_states(batch, heads, nq, nk, block_m, block_n, device).to(device)


def coarsen(states: Tensor, factor_m: int, factor_n: int) -> Tensor:
    """States of tiles ``factor_m`` x ``factor_n`` times larger: EMPTY if every sub-tile is,
    FULL if every sub-tile is, PARTIAL otherwise."""
    if factor_m == factor_n == 1:
        return states
    qb, kb = states.shape[-2:]
    pad = (0, -kb % factor_n, 0, -qb % factor_m)
    # Sub-tiles beyond the matrix count as neither allowed nor denied.
    empty = F.pad((states == EMPTY).to(torch.uint8), pad, value=1)
    full = F.pad((states == FULL).to(torch.uint8), pad, value=1)
    shape = (*states.shape[:2], empty.shape[-2] // factor_m, factor_m, empty.shape[-1] // factor_n,
             factor_n)
    all_empty = empty.view(shape).amin(dim=(3, 5)).bool()
    all_full = full.view(shape).amin(dim=(3, 5)).bool()
    # torch.where, not boolean indexing: on CUDA that would wait for the GPU on every call.
    coarse = torch.full(all_empty.shape, PARTIAL, dtype=torch.uint8, device=states.device)
    coarse = torch.where(all_empty, EMPTY, coarse)
    return torch.where(all_full, FULL, coarse)


def _table(states: Tensor) -> Tensor:
    """(..., R, C) states -> (..., R, 2 + C) int32 [n_partial, n_full, partial..., full...]."""
    cols = states.shape[-1]
    rank = torch.where(states == PARTIAL, 0, torch.where(states == FULL, 1, 2))
    order = torch.argsort(rank * cols + torch.arange(cols, device=states.device), dim=-1)
    counts = [(states == PARTIAL).sum(-1, keepdim=True), (states == FULL).sum(-1, keepdim=True)]
    return torch.cat([*counts, order], dim=-1).to(torch.int32).contiguous()


def _ragged_partial(states: Tensor, nk: int, block_n: int) -> Tensor:
    """A ragged last key tile is never FULL: its padding columns must still be masked out."""
    if nk % block_n == 0:
        return states
    last = torch.arange(states.shape[-1], device=states.device) == states.shape[-1] - 1
    return torch.where(last & (states == FULL), PARTIAL, states)


def row_table(states: Tensor, nk: int, block_n: int) -> Tensor:
    """Key tiles per query tile (the forward and dQ kernels)."""
    return _table(_ragged_partial(states, nk, block_n))


def column_table(states: Tensor, nk: int, block_n: int) -> Tensor:
    """Query tiles per key tile (the dK/dV kernel)."""
    return _table(_ragged_partial(states, nk, block_n).transpose(-1, -2))

