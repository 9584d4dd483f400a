"""The functional core: ``attention``, masks, score modifiers, similarities and engines."""

from .api import attention
from .masks import (
    EMPTY,
    FULL,
    PARTIAL,
    Mask,
    causal,
    custom_mask,
    graph,
    padding,
    segments,
    sliding_window,
)
from .scores import ScoreMod, alibi, relative_bias, softcap
from .similarity import SIMILARITIES

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Mask",
    "SIMILARITIES",
    "ScoreMod",
    "alibi",
    "attention",
    "causal",
    "custom_mask",
    "graph",
    "padding",
    "relative_bias",
    "segments",
    "sliding_window",
    "softcap",
]
