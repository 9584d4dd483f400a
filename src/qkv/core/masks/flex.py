"""FlexAttention's ``BlockMask`` as a qkv mask, with FlexAttention's meaning.

A ``BlockMask`` (``torch.nn.attention.flex_attention.create_block_mask``) holds a rule,
``mask_mod(b, h, q_idx, kv_idx)``, and two tables of (query block, key block) tiles: the
partial ones, where FlexAttention evaluates the rule, and the full ones, which it takes whole
without evaluating it. A tile in neither table is skipped. ``FlexBlockMask`` keeps that
meaning score by score: a key is allowed where its tile is full, or partial and the rule
allows it. Its indices are raw (top-left), as FlexAttention's are.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..pointwise import pointwise
from .base import EMPTY, FULL, PARTIAL, Mask, block_count, broadcast_index


def is_block_mask(value) -> bool:
    """Whether ``value`` is a FlexAttention ``BlockMask`` (checked by type name, so that
    FlexAttention is imported only by the code that made one)."""
    kind = type(value)
    return kind.__name__ == "BlockMask" and kind.__module__.startswith("torch.nn.attention")


def _dense_blocks(num: Tensor | None, indices: Tensor | None, key_blocks: int) -> Tensor | None:
    """(B, H, QB) counts and (B, H, QB, K) key-block indices -> (B, H, QB, key_blocks) bool."""
    if num is None or indices is None:
        return None
    valid = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)
    columns = torch.where(valid, indices.long(), key_blocks)
    dense = torch.zeros(*indices.shape[:-1], key_blocks + 1, dtype=torch.bool,
                        device=indices.device)
    return dense.scatter_(-1, columns, True)[..., :key_blocks]


class FlexBlockMask(Mask):
    """A FlexAttention ``BlockMask``: allowed where the tile is full, or partial and
    ``mask_mod`` allows it."""

    def __init__(self, block_mask):
        self.seq_lengths = tuple(int(n) for n in block_mask.seq_lengths)
        self.block_size = tuple(int(n) for n in block_mask.BLOCK_SIZE)
        key_blocks = block_count(self.seq_lengths[1], self.block_size[1])
        self.partial = _dense_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, key_blocks)
        full = _dense_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices,
                             key_blocks)
        self.full = torch.zeros_like(self.partial) if full is None else full
        fn = block_mask.mask_mod
        self.fn = None if getattr(fn, "__name__", "") == "noop_mask" else fn

    def tensors(self):
        return (self.partial, self.full)

    def check(self, batch, heads, nq, nk):
        if self.seq_lengths != (nq, nk):
            raise ValueError(
                f"block_mask was made for (Q_LEN, KV_LEN) = {self.seq_lengths}; the attention "
                f"has (Nq, Nk) = {(nq, nk)}: make it with create_block_mask(..., {nq}, {nk})")
        for name, size, n in (("B", self.partial.shape[0], batch),
                              ("H", self.partial.shape[1], heads)):
            if size not in (1, n):
                raise ValueError(f"block_mask was made for {name}={size}; the attention has "
                                 f"{name}={n} (make it with {name}=None to broadcast)")

    def _tile(self, table: Tensor, b, h, q_idx, kv_idx):
        return broadcast_index(table.to(q_idx.device), b, h, q_idx // self.block_size[0],
                               kv_idx // self.block_size[1])

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        partial = self._tile(self.partial, b, h, q_idx, kv_idx)
        if self.fn is not None:
            partial = partial & pointwise(self.fn, b, h, q_idx, kv_idx).bool()
        return self._tile(self.full, b, h, q_idx, kv_idx) | partial

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        """From the block tables, without evaluating the rule: a qkv tile is EMPTY where
        every FlexAttention tile it overlaps is skipped, FULL where every one is full."""
        self.check(batch, heads, nq, nk)
        states = torch.full(self.partial.shape, EMPTY, dtype=torch.uint8, device=device)
        states[self.partial.to(device)] = PARTIAL
        states[self.full.to(device)] = FULL
        rows = torch.arange(nq, device=device) // self.block_size[0]
        cols = torch.arange(nk, device=device) // self.block_size[1]
        per_row = _reduce(states[:, :, rows, :], 2, block_q)
        return _reduce(per_row[..., cols], 3, block_k)

    def __repr__(self) -> str:
        return f"block_mask({self.seq_lengths}, BLOCK_SIZE={self.block_size})"


def _reduce(states: Tensor, dim: int, block: int) -> Tensor:
    """Fold ``dim`` into blocks of ``block``: EMPTY if all EMPTY, FULL if all FULL, else
    PARTIAL (the ragged last block padded with its own last entry)."""
    n = states.shape[dim]
    padded = torch.cat([states, states.narrow(dim, n - 1, 1).expand(
        *(s if d != dim else block_count(n, block) * block - n
          for d, s in enumerate(states.shape)))], dim)
    shape = list(states.shape)
    shape[dim:dim + 1] = [block_count(n, block), block]
    blocks = padded.reshape(shape)
    low, high = blocks.amin(dim + 1), blocks.amax(dim + 1)
    out = torch.full_like(low, PARTIAL)
    out[high == EMPTY] = EMPTY
    out[low == FULL] = FULL
    return out
