"""The attention kinds a block can use, chosen by a config string (``BlockConfig.attention``).

``ATTENTION_KINDS`` lists every built-in kind explicitly: a name maps to a builder, called
once per layer when a block is built (``register_attention_kind`` adds a user's own).
A kind must implement this protocol:

Constructor (the builder), keywords only:
    builder(*, d_model, n_head, n_kv_head, bias, dropout, similarity, weighting, rope,
            is_cross, depth, forget_gate) -> nn.Module
    ``rope`` is a shared ``RotaryEmbedding`` or None (self-attention only); ``is_cross`` is
    True for encoder-decoder attention, whose keys come from a memory (a block names that
    layer ``cross_attn``; the viewer reads layers from such module paths). ``weighting``
    names how scores become weights (``qkv.weighting``). ``depth`` is the layer's 0-based
    index in its stack (differential attention's λ_init reads it); ``forget_gate`` asks for
    forgetting attention's gate on the scores (``qkv.forget_gate``). A kind that cannot
    honour an argument (say, a similarity, a weighting or a forget gate) raises ValueError
    there.

Forward:
    module(x, memory=None, *, mask=None, score_mod=None, positions=None, cache=None)
        -> (B, N, d_model)
    x (B, N, d_model); memory (B, M, d_model) for cross-attention (None on later cached
    calls); mask a qkv mask object or bool tensor (blocks pass ``qkv.causal()`` for causal
    stacks, combined with padding); score_mod from the positional scheme (ALiBi, T5 bias);
    positions (N,) or (B, N) absolute positions of x's tokens (for rope).

Cache / state for generation:
    module.new_cache(batch, max_len, *, device=None, dtype=None) -> a cache object, any
    class, created empty; passing it to forward makes the call incremental: x holds only
    the new positions and the object absorbs them (a KV cache, or a recurrent state).
    The object must implement ``reorder(index)`` (keep batch rows ``index`` in that order,
    for beam search). For cross-attention the first cached call receives the memory and
    later calls receive memory=None.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .attention import MultiHeadAttention
from .differential import differential_kind
from .linear_attention import linear_kind
from .retention import retention_kind


def multihead_kind(*, d_model, n_head, n_kv_head, bias, dropout, similarity, weighting, rope,
                   is_cross, depth, forget_gate) -> MultiHeadAttention:
    """The builder of attention kind "multihead": ``qkv.attention`` with the block's
    similarity and weighting; the forget gate goes on self-attention (a decoder's
    cross-attention has no order of positions to forget along)."""
    return MultiHeadAttention(
        d_model, n_head, n_kv_head=n_kv_head, bias=bias, dropout=dropout,
        similarity=similarity, weighting=weighting, rope=rope, is_cross=is_cross,
        forget_gate=forget_gate and not is_cross,
    )


ATTENTION_KINDS: dict[str, Callable[..., nn.Module]] = {
    "multihead": multihead_kind,
    "linear": linear_kind("elu", "linear"),
    "linear_favor": linear_kind("favor", "linear_favor"),
    "retention": retention_kind,
    "differential": differential_kind,
}


def register_attention_kind(name: str, factory: Callable[..., nn.Module]) -> None:
    """Make ``attention=name`` available to every model config (see the module docstring)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"attention kind name must be a non-empty string; got {name!r}")
    if not callable(factory):
        raise TypeError(f"attention kind factory must be callable; got {type(factory).__name__}")
    ATTENTION_KINDS[name] = factory


def build_attention(kind: str, *, weighting="softmax", depth: int = 0,
                    forget_gate: bool = False, **kwargs) -> nn.Module:
    """One attention layer of ``kind`` (keywords as in the protocol; by default a softmax
    layer, the first of its stack, without a forget gate)."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {sorted(ATTENTION_KINDS)}; got {kind!r}")
    return ATTENTION_KINDS[kind](weighting=weighting, depth=depth, forget_gate=forget_gate,
                                 **kwargs)
