"""Layers: multi-head attention, positions, feed-forward, norms and Transformer blocks."""

from .attention import KVCache, MultiHeadAttention
from .blocks import (
    BlockConfig,
    DecoderBlock,
    Sublayer,
    TransformerBlock,
    attention_layer,
    decoder_block,
    transformer_block,
)
from .differential import DifferentialAttention
from .feedforward import ACTIVATIONS, MLP, GatedMLP, feed_forward
from .kinds import ATTENTION_KINDS, build_attention, register_attention_kind
from .linear import Linear
from .linear_attention import LinearAttention, StateCache
from .norms import NORMS, RMSNorm, make_norm
from .positions import (
    POSITION_KINDS,
    ALiBiPositions,
    LearnedPositions,
    NoPositions,
    PositionScheme,
    PositionsConfig,
    RelativePositions,
    RotaryEmbedding,
    RotaryPositions,
    SinusoidalPositions,
    make_positions,
    sinusoidal_encoding,
)
from .retention import Retention

__all__ = [
    "ACTIVATIONS", "ATTENTION_KINDS", "ALiBiPositions", "BlockConfig", "DecoderBlock",
    "DifferentialAttention", "GatedMLP", "KVCache", "LearnedPositions", "Linear",
    "LinearAttention", "MLP", "MultiHeadAttention",
    "NORMS", "NoPositions", "POSITION_KINDS", "PositionScheme", "PositionsConfig",
    "RMSNorm", "RelativePositions", "Retention", "RotaryEmbedding", "RotaryPositions",
    "SinusoidalPositions", "StateCache", "Sublayer", "TransformerBlock", "attention_layer",
    "build_attention", "decoder_block", "feed_forward", "make_norm", "make_positions",
    "register_attention_kind", "sinusoidal_encoding", "transformer_block",
]
