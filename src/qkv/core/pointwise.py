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
    for one score each: ``fn`` is called on them directly.

    One ``torch.vmap`` per dimension that some argument spans (as FlexAttention nests them),
    each mapping only the arguments that vary along it: a slope read per head is computed per
    head, not per score, and index grids are never expanded to the full shape."""
    if not all(isinstance(a, Tensor) for a in args):
        return fn(*args)
    shape = torch.broadcast_shapes(*(a.shape for a in args))
    if not all(shape):  # an empty grid: vmap needs a batch, and there is nothing to compute
        return torch.as_tensor(fn(*(a.expand(shape) for a in args)))
    args = [a.reshape((1,) * (len(shape) - a.dim()) + tuple(a.shape)) for a in args]
    out = _mapped(fn, len(shape))(*args)
    return out if out.shape == shape else out.expand(shape)


def _mapped(fn: Callable, ndim: int) -> Callable:
    """``fn`` mapped over the leading ``ndim`` dims of its arguments (each of size 1 or the
    broadcast size)."""
    if ndim == 0:
        return lambda *one: torch.as_tensor(fn(*one))
    inner = _mapped(fn, ndim - 1)

    def over_first_dim(*args):
        dims = tuple(0 if a.shape[0] > 1 else None for a in args)
        rest = [a if d == 0 else a.squeeze(0) for a, d in zip(args, dims, strict=True)]
        if all(d is None for d in dims):
            return inner(*rest).unsqueeze(0)
        return torch.vmap(inner, in_dims=dims)(*rest)

    return over_first_dim
