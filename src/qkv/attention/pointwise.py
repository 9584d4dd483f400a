"""FlexAttention's semantics for user callables: one score at a time.

FlexAttention calls ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx,
kv_idx)`` as if once per score, with 0-d index tensors, so a callable may index a tensor one
dimension after another (``bias[b][q_idx]``, ``table[h][q_idx - kv_idx]``). qkv's engines
hold indices as broadcastable grids (a tile's ``(B,1,1,1)``, ``(1,H,1,1)``, ...; a graph's
edge lists), on which such a callable would index the wrong dimension. ``pointwise`` gives it
the per-score view with ``torch.vmap`` over the broadcast grid: exact, differentiable in the
tensors the callable reads, and batched like the grid itself. Built-in modifiers and masks
are written for grids and keep calling themselves directly (the fast path).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def pointwise(fn: Callable, *args) -> Tensor:
    """``fn(*args)`` evaluated per element of the broadcast of ``args`` (each call sees 0-d
    tensors), shaped like that broadcast. Symbolic values (an engine's tracer) already stand
    for one score each: ``fn`` is called on them directly."""
    if not all(isinstance(a, Tensor) for a in args):
        return fn(*args)
    shape = torch.broadcast_shapes(*(a.shape for a in args))
    if not all(shape):  # an empty grid: vmap needs a batch, and there is nothing to compute
        return torch.as_tensor(fn(*(a.expand(shape) for a in args)))
    flat = [a.expand(shape).reshape(-1) for a in args]
    out = torch.vmap(lambda *one: torch.as_tensor(fn(*one)))(*flat)
    return out.view(shape)
