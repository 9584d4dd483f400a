"""qkv: the attention mechanism and the Transformer, exact and fast, on PyTorch."""

from . import models, nn  # noqa: F401  (qkv.models, qkv.nn)
from .core import (
    Mask,
    ScoreMod,
    Similarity,
    alibi,
    attention,
    block_sparse,
    causal,
    custom_mask,
    dilated_window,
    fixed,
    global_local,
    global_tokens,
    graph,
    padding,
    register_similarity,
    relative_bias,
    segments,
    sliding_window,
    softcap,
    strided,
)

__version__ = "0.1.0"

__all__ = [
    "block_sparse",
    "dilated_window",
    "fixed",
    "global_local",
    "global_tokens",
    "strided",
    "Mask",
    "ScoreMod",
    "Similarity",
    "alibi",
    "attention",
    "causal",
    "custom_mask",
    "graph",
    "padding",
    "register_similarity",
    "relative_bias",
    "segments",
    "sliding_window",
    "softcap",
]
