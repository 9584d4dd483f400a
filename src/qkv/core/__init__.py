"""The math of attention: masks, score modifiers, similarities, the request, the reference;
linear attention, retention and block-sparse patterns. It imports no engine."""

from .forget import forget_gate
from .linear import (
    LinearState,
    draw_orthogonal_features,
    linear_attention,
    linear_attention_step,
)
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
from .retention import decay_matrix, retention, retention_decays, retention_step
from .scores import ScoreMod, alibi, relative_bias, softcap
from .similarity import SIMILARITIES, Similarity, register_similarity
from .sparse import block_sparse, dilated_window, fixed, global_local, global_tokens, strided

__all__ = [
    "LinearState",
    "block_sparse",
    "decay_matrix",
    "dilated_window",
    "draw_orthogonal_features",
    "fixed",
    "forget_gate",
    "global_local",
    "global_tokens",
    "linear_attention",
    "linear_attention_step",
    "retention",
    "retention_decays",
    "retention_step",
    "strided",
    "EMPTY",
    "FULL",
    "PARTIAL",
    "Mask",
    "SIMILARITIES",
    "ScoreMod",
    "Similarity",
    "alibi",
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
