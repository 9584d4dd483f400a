"""Layers: multi-head attention, positions, feed-forward, norms and Transformer blocks."""

from . import linear_attention, retention  # noqa: F401  (register "linear", "retention" kinds)
from .attention import KVCache, MultiHeadAttention
from .blocks import BlockConfig, DecoderBlock, Sublayer, TransformerBlock
from .feedforward import ACTIVATIONS, FeedForward
from .kinds import ATTENTION_KINDS, build_attention, register_attention_kind
from .linear_attention import LinearAttention, StateCache
from .norms import NORMS, RMSNorm, make_norm
from .positions import (
    POSITION_KINDS,
    LearnedPositions,
    Positions,
    RotaryEmbedding,
    sinusoidal_encoding,
)
from .retention import Retention

__all__ = [
    "LinearAttention", "Retention", "StateCache",
    "ACTIVATIONS", "ATTENTION_KINDS", "BlockConfig", "DecoderBlock", "FeedForward", "KVCache",
    "LearnedPositions", "MultiHeadAttention", "NORMS", "POSITION_KINDS", "Positions", "RMSNorm",
    "RotaryEmbedding", "Sublayer", "TransformerBlock", "build_attention", "make_norm",
    "register_attention_kind", "sinusoidal_encoding",
]
