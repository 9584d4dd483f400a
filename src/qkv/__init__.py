"""qkv: the attention mechanism and the Transformer, exact and fast, on PyTorch."""

from . import models, nn  # noqa: F401  (qkv.models, qkv.nn)
from .attention import (
    Mask,
    ScoreMod,
    alibi,
    attention,
    causal,
    custom_mask,
    graph,
    padding,
    relative_bias,
    segments,
    sliding_window,
    softcap,
)

__version__ = "0.1.0"

__all__ = [
    "Mask",
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
