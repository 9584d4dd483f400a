"""``Carry.STICK``: stick-breaking attention, and the check that a mask keeps every query to
the keys before it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kept import Kept
from ..masks import EMPTY, FULL, CausalMask, Mask, causal
from .base import Carry, Weighting, zero_masked

# Masks found to keep every query to the keys before it, by layout key and shape.
_IN_ORDER = Kept(64)


class StickBreaking(Weighting):
    """β_ij ∏_{l∈M, j<l<i} (1 − β_il), β = σ(s) (Tan et al., "Scaling Stick-Breaking
    Attention", ICLR 2025): each key takes a share β of the stick the nearer keys left, so
    rows sum to at most 1 and the weights encode order without positions. Keys j < i (j <= i
    and l <= i with ``include_self``), positions bottom-right aligned as ``qkv.causal()``."""

    name = "stick_breaking"
    carry = Carry.STICK

    def __init__(self, include_self: bool = False):
        if not isinstance(include_self, bool):
            raise TypeError(f"stick_breaking: include_self must be a bool; got "
                            f"{include_self!r}")
        self.include_self = include_self

    def in_order(self, pos_q: Tensor, kv_idx: Tensor) -> Tensor:
        """The keys a query may break the stick over: j < i, or j <= i with include_self."""
        return kv_idx <= pos_q if self.include_self else kv_idx < pos_q

    def check_mask(self, mask: Mask | None, batch: int, heads: int, nq: int, nk: int,
                   device=None) -> None:
        """Raise ValueError when ``mask`` lets some query see a key after its own position:
        the stick is broken in key order, from the query back. Tiles are classified first,
        and only those that hold both allowed and forbidden later keys are evaluated. A mask
        with a layout key (``Mask.layout_key``) passes once per shape: a decode step would
        otherwise classify it in every layer of every token."""
        if type(mask) is CausalMask:  # within itself by definition
            return
        if mask is None:
            if nq > 1:
                raise ValueError("weighting='stick_breaking' breaks the stick over the keys "
                                 "before each query: pass mask=qkv.causal() (or a mask within "
                                 "it); with no mask, queries would see later keys")
            return
        key = mask.layout_key()
        key = None if key is None else (key, batch, heads, nq, nk)
        if key is not None and _IN_ORDER.get(key):
            return
        later = mask & ~causal()
        block = 128
        states = later.tile_states(batch, heads, nq, nk, block, block, device)
        found = bool((states == FULL).any())
        for qi, kj in (states != EMPTY).any(1).any(0).nonzero().tolist() if not found else ():
            q0, k0 = qi * block, kj * block
            q = torch.arange(q0, min(nq, q0 + block), device=device).view(1, 1, -1, 1)
            k = torch.arange(k0, min(nk, k0 + block), device=device).view(1, 1, 1, -1)
            b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
            h = torch.arange(heads, device=device).view(1, -1, 1, 1)
            if bool(torch.as_tensor(later.mask_mod(b, h, q, k, nk - nq)).any()):
                found = True
                break
        if found:
            raise ValueError(f"weighting='stick_breaking' breaks the stick over the keys "
                             f"before each query, but the mask {mask!r} lets a query see a "
                             f"later key: combine it with qkv.causal()")
        if key is not None:
            _IN_ORDER.keep(key, True)

    def weights(self, s, allowed, pos_q, kv_idx, heads=None):
        keep = allowed & self.in_order(pos_q, kv_idx)
        safe = zero_masked(s, keep)
        # log(1 - β) = -softplus(s); the stick left before key j is exp(-Σ_{l>j} softplus).
        spent = zero_masked(F.softplus(safe), keep)
        after = spent.flip(-1).cumsum(-1).flip(-1) - spent
        return zero_masked(torch.exp(F.logsigmoid(safe) - after), keep)

    def __repr__(self):
        return f"stick_breaking(include_self={self.include_self})"
