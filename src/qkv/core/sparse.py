"""Sparse attention patterns as mask objects: the same engines run them and skip the tiles
``tile_states`` rules out, so cost follows the number of non-empty tiles.

Positions are bottom-right aligned as everywhere in qkv: query i sits at key position
p = i + Nk - Nq. Every pattern composes with the other masks through ``&``, ``|`` and ``~``
(``strided(s) & qkv.causal()`` is the Sparse Transformer's strided head).

- ``strided(stride)``, ``dilated_window(left, dilation, right)``: keys at distances that are
  multiples of the stride (Child et al. 2019; Longformer's dilated window).
- ``fixed(block, summary)``: the Sparse Transformer's fixed pattern.
- ``global_tokens(positions)``: global tokens see and are seen by every token.
- ``global_local(window, global_tokens, random_blocks=...)``: Longformer / BigBird, a local
  window plus global tokens plus random key blocks, built with ``|`` from the pieces here.
- ``block_sparse(layout, block_size)``: an explicit (Qb, Kb) layout of allowed blocks.

``tile_states`` is exact for every class here (EMPTY and FULL exactly where they hold).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .masks import Mask, SlidingWindowMask, as_4d, states_from, tile_bounds


def _check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return value


def _tile_positions(nq, nk, block_q, block_k, device):
    """Per tile: first/last query position (Qt, 1) and first/last key (1, Kt)."""
    p0, p1 = (t.view(-1, 1) + (nk - nq) for t in tile_bounds(nq, block_q, device))
    j0, j1 = (t.view(1, -1) for t in tile_bounds(nk, block_k, device))
    return p0, p1, j0, j1


def _ceil_div(a: Tensor, b: int) -> Tensor:
    return -torch.div(-a, b, rounding_mode="floor")


class StridedMask(Mask):
    """Key j is allowed for position p when p - j is a multiple of ``stride`` and lies in
    [-right, left] (None: unbounded on that side)."""

    def __init__(self, stride: int, left: int | None = None, right: int | None = None):
        self.stride = _check_int(stride, "stride", 1)
        self.left = None if left is None else _check_int(left, "left", 0)
        self.right = None if right is None else _check_int(right, "right", 0)

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        distance = q_idx + offset - kv_idx
        allowed = distance % self.stride == 0
        if self.left is not None:
            allowed = allowed & (distance <= self.left)
        if self.right is not None:
            allowed = allowed & (distance >= -self.right)
        return allowed

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        p0, p1, j0, j1 = _tile_positions(nq, nk, block_q, block_k, device)
        # Every distance between lo and hi occurs in the tile (both ranges are intervals).
        lo, hi = p0 - j1, p1 - j0
        lo_in = lo if self.right is None else lo.clamp(min=-self.right)
        hi_in = hi if self.left is None else hi.clamp(max=self.left)
        first_multiple = _ceil_div(lo_in, self.stride) * self.stride
        empty = first_multiple > hi_in
        inside = torch.ones_like(empty)
        if self.right is not None:
            inside = inside & (lo >= -self.right)
        if self.left is not None:
            inside = inside & (hi <= self.left)
        one_distance = (lo == hi) & (lo % self.stride == 0)
        full = inside & ((self.stride == 1) | one_distance)
        return as_4d(states_from(full, empty))

    def __repr__(self) -> str:
        return f"strided({self.stride}, left={self.left}, right={self.right})"


class FixedMask(Mask):
    """The Sparse Transformer's fixed pattern: key j is allowed for position p when both lie in
    the same block of ``block`` positions, or when j is one of the last ``summary`` positions
    of its block."""

    def __init__(self, block: int, summary: int = 1):
        self.block = _check_int(block, "block", 1)
        self.summary = _check_int(summary, "summary", 0)
        if summary > block:
            raise ValueError(f"summary must be <= block={block}; got {summary}")

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        # Operands of // and % stay >= 0, where every backend's integer division agrees.
        pos = q_idx + offset
        same_block = (pos >= 0) & (pos.clamp(min=0) // self.block == kv_idx // self.block)
        return same_block | (kv_idx % self.block >= self.block - self.summary)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        p0, p1, j0, j1 = _tile_positions(nq, nk, block_q, block_k, device)
        n, cut = self.block, self.block - self.summary  # keys with j % n >= cut summarize

        def floor(t: Tensor) -> Tensor:  # block index, also for negative positions
            return torch.div(t, n, rounding_mode="floor")

        first_summary = torch.where(j0 % n >= cut, j0, j0 - j0 % n + cut)
        has_summary = (first_summary <= j1) & (self.summary > 0)
        share_block = (floor(p0) <= floor(j1)) & (floor(j0) <= floor(p1))
        first_plain = torch.where(j0 % n < cut, j0, (floor(j0) + 1) * n)
        last_plain = torch.where(j1 % n < cut, j1, j1 - j1 % n + cut - 1)
        has_plain = (first_plain <= last_plain) & (cut > 0)
        one_block = (floor(p0) == floor(p1)) & (floor(first_plain) == floor(p0)) & (
            floor(last_plain) == floor(p0)
        )
        full = ~has_plain | one_block
        return as_4d(states_from(full, ~has_summary & ~share_block))

    def __repr__(self) -> str:
        return f"fixed({self.block}, summary={self.summary})"


class GlobalTokensMask(Mask):
    """Global positions attend to every key and every position attends to them."""

    def __init__(self, positions: Tensor):
        self.positions = positions

    def tensors(self):
        return (self.positions,)

    def _is_global(self, idx: Tensor) -> Tensor:
        g = self.positions.to(idx.device)
        if g.numel() == 0:
            return torch.zeros_like(idx, dtype=torch.bool)
        found = torch.searchsorted(g, idx).clamp(max=g.numel() - 1)
        return g[found] == idx

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return self._is_global(q_idx + offset) | self._is_global(kv_idx)

    def _count(self, first: Tensor, last: Tensor) -> Tensor:
        """Number of global positions in [first, last]."""
        g = self.positions.to(first.device)
        return torch.searchsorted(g, last, right=True) - torch.searchsorted(g, first)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        p0, p1, j0, j1 = _tile_positions(nq, nk, block_q, block_k, device)
        rows = self._count(p0.flatten(), p1.flatten()).view(-1, 1)
        cols = self._count(j0.flatten(), j1.flatten()).view(1, -1)
        # Allowed = global rows ∪ global columns: full iff all rows or all columns are global.
        full = (rows == p1 - p0 + 1) | (cols == j1 - j0 + 1)
        return as_4d(states_from(full, (rows == 0) & (cols == 0)))

    def __repr__(self) -> str:
        return f"global_tokens({self.positions.tolist()})"


class BlockSparseMask(Mask):
    """An explicit layout: key j is allowed for position p when
    ``layout[b, h, p // block_size, j // block_size]``. Positions before 0 (Nq > Nk) see
    nothing."""

    def __init__(self, layout: Tensor, block_size: int):
        is_bool = isinstance(layout, Tensor) and layout.dtype == torch.bool
        if not is_bool or not 2 <= layout.dim() <= 4:
            raise ValueError(
                "block_sparse: layout must be a bool tensor (Qb, Kb), (H, Qb, Kb) or "
                f"(B, H, Qb, Kb); got {getattr(layout, 'dtype', type(layout).__name__)} "
                f"{tuple(getattr(layout, 'shape', ()))}"
            )
        self.layout = as_4d(layout)
        self.block_size = _check_int(block_size, "block_size", 1)

    def tensors(self):
        return (self.layout,)

    def check(self, batch, heads, nq, nk):
        bl, hl, qb, kb = self.layout.shape
        if bl not in (1, batch) or hl not in (1, heads):
            raise ValueError(
                f"block_sparse: layout of shape {tuple(self.layout.shape)} does not broadcast "
                f"to batch {batch} and {heads} heads"
            )
        covered = min(qb, kb) * self.block_size
        if nk > covered:
            raise ValueError(
                f"block_sparse: the layout covers {covered} positions ({qb}x{kb} blocks of "
                f"{self.block_size}); the problem has Nk={nk}"
            )

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        layout = self.layout.to(q_idx.device)
        pos = q_idx + offset
        row = pos.clamp(min=0) // self.block_size
        bi = b if layout.shape[0] > 1 else 0
        hi = h if layout.shape[1] > 1 else 0
        return layout[bi, hi, row, kv_idx // self.block_size] & (pos >= 0)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        self.check(batch, heads, nq, nk)
        p0, p1, j0, j1 = _tile_positions(nq, nk, block_q, block_k, device)
        bs = self.block_size
        r0, r1 = p0.clamp(min=0) // bs, p1.clamp(min=0) // bs
        c0, c1 = j0 // bs, j1 // bs
        # Count allowed layout blocks in each tile's rectangle with a summed-area table.
        table = self.layout.to(device).long().cumsum(-2).cumsum(-1)
        table = torch.nn.functional.pad(table, (1, 0, 1, 0))
        count = (table[:, :, r1 + 1, c1 + 1] - table[:, :, r0, c1 + 1]
                 - table[:, :, r1 + 1, c0] + table[:, :, r0, c0])
        area = (r1 - r0 + 1) * (c1 - c0 + 1)
        full = (count == area) & (p0 >= 0)
        empty = (count == 0) | (p1 < 0)
        return states_from(full, empty)

    def __repr__(self) -> str:
        return f"block_sparse(layout {tuple(self.layout.shape)}, block_size={self.block_size})"


def strided(stride: int) -> Mask:
    """Keys at distances that are multiples of ``stride`` (both directions; & qkv.causal()
    for the Sparse Transformer's strided head)."""
    return StridedMask(stride)


def dilated_window(left: int, dilation: int, right: int = 0) -> Mask:
    """A dilated sliding window: keys p + t·dilation for t in [-left, right]
    (``dilation=1`` is ``qkv.sliding_window(left, right)``)."""
    _check_int(left, "left", 0)
    _check_int(right, "right", 0)
    _check_int(dilation, "dilation", 1)
    return StridedMask(dilation, left * dilation, right * dilation)


def fixed(block: int, summary: int = 1) -> Mask:
    """The Sparse Transformer's fixed pattern (& qkv.causal() for language models)."""
    return FixedMask(block, summary)


def global_tokens(positions: int | Sequence[int] | Tensor) -> Mask:
    """Global tokens: an int n (the first n positions) or explicit key positions."""
    if isinstance(positions, int) and not isinstance(positions, bool):
        _check_int(positions, "global_tokens", 0)
        return GlobalTokensMask(torch.arange(positions))
    tensor = torch.as_tensor(positions)
    if tensor.dim() != 1 or tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise ValueError(
            "global_tokens: positions must be an int or a 1-D integer sequence; got "
            f"{tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    if (tensor < 0).any():
        raise ValueError("global_tokens: positions must be >= 0")
    return GlobalTokensMask(torch.unique(tensor.long()))


def random_block_layout(num_blocks: int, random_blocks: int, seed: int = 0) -> Tensor:
    """(num_blocks, num_blocks) bool with ``random_blocks`` key blocks per query block,
    drawn uniformly without replacement from a generator seeded by ``seed``."""
    _check_int(num_blocks, "num_blocks", 1)
    _check_int(random_blocks, "random_blocks", 0)
    g = torch.Generator().manual_seed(seed)
    picks = torch.rand(num_blocks, num_blocks, generator=g).argsort(-1)[:, :random_blocks]
    layout = torch.zeros(num_blocks, num_blocks, dtype=torch.bool)
    return layout.scatter_(1, picks, True)


def global_local(
    window: int, global_positions: int | Sequence[int] | Tensor = 0, *, random_blocks: int = 0,
    block_size: int = 64, max_len: int | None = None, seed: int = 0,
) -> Mask:
    """Longformer / BigBird: a local window of ``window`` keys on each side, global tokens,
    and (BigBird) ``random_blocks`` random key blocks of ``block_size`` per query block, over
    sequences up to ``max_len`` (needed for the random layout)."""
    _check_int(window, "window", 0)
    mask: Mask = SlidingWindowMask(window, window)
    tokens = global_tokens(global_positions)
    if tokens.positions.numel():
        mask = mask | tokens
    if random_blocks:
        if max_len is None:
            raise ValueError("global_local: random_blocks needs max_len (the longest sequence)")
        _check_int(max_len, "max_len", 1)
        num_blocks = -(-max_len // _check_int(block_size, "block_size", 1))
        layout = random_block_layout(num_blocks, min(random_blocks, num_blocks), seed)
        mask = mask | BlockSparseMask(layout, block_size)
    return mask


def block_sparse(layout: Tensor, block_size: int) -> Mask:
    """An explicit block layout: bool (Qb, Kb), (H, Qb, Kb) or (B, H, Qb, Kb), True where
    query block i may attend to key block j."""
    return BlockSparseMask(layout, block_size)
