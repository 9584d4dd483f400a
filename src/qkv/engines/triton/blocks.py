"""Block tables from a mask's tile classification (FlexAttention's BlockMask, in one tensor).

A row table (B|1, H|1, QB, 2 + KB) int32 lists, per query tile: the number of PARTIAL key
tiles, the number of FULL key tiles, then their indices (partial first, then full, each in
ascending order). A column table (B|1, H|1, KB, 2 + QB) lists query tiles per key tile, for
the dK/dV kernel. EMPTY tiles are never listed, so the kernels never visit them.

Classifying and sorting take dozens of small GPU operations, as long as the kernels of a
sparse mask on a long sequence: a mask with a ``Mask.layout_key`` (a rule alone, or a rule
over tensors unchanged since: segments, padding) keeps its layout between calls of the same
shape, as a FlexAttention user keeps a BlockMask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.kept import Kept
from ...core.masks import EMPTY, FULL, PARTIAL, Mask


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


class BlockLayout:
    """The tile states at the finest tiles (``fine_m`` x ``fine_n``) of a call's kernels, and
    the block tables coarsened from them, each made when a kernel first needs it: a forward
    without gradients builds one table, not three."""

    def __init__(self, fine: Tensor, fine_m: int, fine_n: int, nk: int):
        self.fine, self.fine_m, self.fine_n, self.nk = fine, fine_m, fine_n, nk
        self.tables: dict[tuple[int, int, bool], Tensor] = {}

    def table(self, block_m: int, block_n: int, by_keys: bool = False) -> Tensor:
        """Key tiles per query tile of block_m x block_n tiles (query tiles per key tile if
        ``by_keys``). Read-only: a layout may serve later calls."""
        key = (block_m, block_n, by_keys)
        if key not in self.tables:
            states = coarsen(self.fine, block_m // self.fine_m, block_n // self.fine_n)
            make = column_table if by_keys else row_table
            self.tables[key] = make(states, self.nk, block_n)
        return self.tables[key]


_layouts = Kept(64)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream: a kept layout
    used by a graph could be evicted and freed while the graph still reads it."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def block_layout(mask: Mask | None, batch: int, heads: int, nq: int, nk: int, fine_m: int,
                 fine_n: int, device) -> BlockLayout:
    """The layout of ``mask`` on a (batch, heads, nq, nk) problem: the one kept from an
    earlier call where the mask's layout_key allows (the last 64 kept), else made now; always
    made now while a CUDA graph is captured (the graph then owns it)."""
    device = torch.device(device)

    def make() -> BlockLayout:
        states = classify(mask, batch, heads, nq, nk, fine_m, fine_n, device)
        return BlockLayout(states, fine_m, fine_n, nk)

    rule = ("none",) if mask is None else mask.layout_key()
    if rule is None or _capturing(device):
        return make()
    return _layouts.get_or_make((rule, batch, heads, nq, nk, fine_m, fine_n, device), make)
