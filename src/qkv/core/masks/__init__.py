"""Mask objects: which keys each query may attend to.

A mask is one small rule, ``mask_mod(b, h, q_idx, kv_idx, offset) -> bool``, evaluated on
broadcastable index tensors. ``offset = Nk - Nq`` aligns queries to the bottom right of the
score matrix, so query ``i`` sits at key position ``i + offset`` (what a KV cache needs).

Every engine derives from the same rule:
- the reference materializes it as a (B|1, H|1, Nq, Nk) bool tensor;
- the fused engines evaluate it per tile, and first ask ``tile_states`` which
  (query-block, key-block) tiles are EMPTY (skip), FULL (no masking) or PARTIAL.

Masks combine with ``&``, ``|`` and ``~``. ``tile_states`` is exact for EMPTY and FULL where it
says so; PARTIAL is always a safe answer.
"""

from .base import (
    EMPTY,
    FULL,
    PARTIAL,
    AndMask,
    Mask,
    NotMask,
    OrMask,
    TensorMask,
    as_4d,
    as_mask,
    index_grid,
    states_from,
    tile_bounds,
)
from .rules import (
    CausalMask,
    CustomMask,
    GraphMask,
    PaddingMask,
    SegmentMask,
    SlidingWindowMask,
    causal,
    custom_mask,
    graph,
    padding,
    segments,
    sliding_window,
)

__all__ = [
    "AndMask",
    "CausalMask",
    "CustomMask",
    "EMPTY",
    "FULL",
    "GraphMask",
    "Mask",
    "NotMask",
    "OrMask",
    "PARTIAL",
    "PaddingMask",
    "SegmentMask",
    "SlidingWindowMask",
    "TensorMask",
    "as_4d",
    "as_mask",
    "causal",
    "custom_mask",
    "graph",
    "index_grid",
    "padding",
    "segments",
    "sliding_window",
    "states_from",
    "tile_bounds",
]
