"""Transformer blocks: attention and feed-forward sublayers with residuals, norms and dropout.

Post-norm (the paper's): x = Norm(x + Dropout(Sublayer(x))).
Pre-norm:                x = x + Dropout(Sublayer(Norm(x))).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..core.similarity import SIMILARITIES
from ..core.weighting import WEIGHTINGS, as_weighting
from ..limits import check_limits, limited
from .attention import MultiHeadAttention
from .feedforward import ACTIVATIONS, feed_forward
from .kinds import ATTENTION_KINDS
from .norms import NORMS, make_norm
from .positions import RotaryEmbedding


@dataclass
class BlockConfig:
    """One Transformer block: its width and heads, its attention and feed-forward sublayers,
    and how they are normalized. Every model config holds one (``config.block``).

    ``n_kv_head``: key/value heads for grouped-query attention (None: n_head); ``d_ff``: the
    feed-forward width (None: 4 * d_model); ``norm_first``: pre-norm (True) or the paper's
    post-norm; ``similarity``, ``weighting`` and ``attention`` name a registered similarity,
    how scores become weights (``qkv.weighting``) and an attention kind (``qkv.nn.kinds``);
    ``forget_gate``: forgetting attention's per-head gate σ(w·x + b) on the self-attention
    scores (``qkv.forget_gate``; attention="multihead" only)."""

    d_model: int = limited(512, "[1, inf)")
    n_head: int = limited(8, "[1, inf)")
    n_kv_head: int | None = limited(None, "[1, inf)")
    d_ff: int | None = limited(None, "[1, inf)")
    dropout: float = limited(0.0, "[0, 1)")
    norm: str = limited("layernorm", choices=NORMS)
    norm_eps: float = limited(1e-5, "(0, inf)")
    norm_first: bool = True
    ffn: str = limited("gelu", choices=ACTIVATIONS)
    bias: bool = True
    similarity: str = limited("dot", choices=lambda: tuple(SIMILARITIES))
    weighting: str = limited("softmax", choices=lambda: tuple(WEIGHTINGS))
    attention: str = limited("multihead", choices=lambda: tuple(ATTENTION_KINDS))
    forget_gate: bool = False

    def __post_init__(self):
        for name in ("d_model", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"BlockConfig: {name} must be a positive int; got {value!r}")
        check_limits(self, "BlockConfig")
        if self.d_model % self.n_head:
            raise ValueError(f"BlockConfig: d_model={self.d_model} must be divisible by "
                             f"n_head={self.n_head}")
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"BlockConfig: n_head={self.n_head} must be divisible by "
                             f"n_kv_head={self.n_kv_head}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def ff_width(self) -> int:
        return self.d_ff or 4 * self.d_model


def attention_layer(cfg: BlockConfig, rope: RotaryEmbedding | None = None,
                    is_cross: bool = False, context: int | None = None,
                    depth: int = 0) -> nn.Module:
    """The attention layer of kind ``cfg.attention`` (``qkv.nn.kinds``). ``context``: the
    model's longest sequence, which fixes the length a weighting reads
    (``Weighting.for_context``); None leaves it to each call. ``depth``: the layer's 0-based
    index in its stack."""
    if cfg.attention not in ATTENTION_KINDS:
        raise ValueError(f"attention must be one of {sorted(ATTENTION_KINDS)}; got "
                         f"{cfg.attention!r}")
    return ATTENTION_KINDS[cfg.attention](
        d_model=cfg.d_model, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head, bias=cfg.bias,
        dropout=cfg.dropout, similarity=cfg.similarity, rope=rope, is_cross=is_cross,
        depth=depth, forget_gate=cfg.forget_gate,
        weighting=(as_weighting(cfg.weighting) if context is None else
                   as_weighting(cfg.weighting).for_context(context)),
    )


def norm_layer(cfg: BlockConfig) -> nn.Module:
    """The norm ``cfg`` names, as a sublayer's or a stack's final norm."""
    return make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)


def sublayer(cfg: BlockConfig) -> Sublayer:
    return Sublayer(norm_layer(cfg), cfg.dropout, cfg.norm_first)


def transformer_block(cfg: BlockConfig, rope: RotaryEmbedding | None = None,
                      context: int | None = None, depth: int = 0) -> TransformerBlock:
    """A self-attention block built from ``cfg`` (``rope``: the stack's shared rotation;
    ``context``: the model's longest sequence, as ``attention_layer`` takes it; ``depth``:
    the block's 0-based index in its stack)."""
    return TransformerBlock(
        attention_layer(cfg, rope, context=context, depth=depth),
        feed_forward(cfg.ffn, cfg.d_model, cfg.ff_width, cfg.dropout, cfg.bias),
        sublayer(cfg), sublayer(cfg),
    )


def decoder_block(cfg: BlockConfig, rope: RotaryEmbedding | None = None,
                  context: int | None = None, depth: int = 0) -> DecoderBlock:
    """A decoder block built from ``cfg``: self-attention, cross-attention, feed-forward
    (``depth``: the block's 0-based index in the decoder)."""
    return DecoderBlock(
        attention_layer(cfg, rope, context=context, depth=depth),
        attention_layer(cfg, None, is_cross=True, context=context, depth=depth),
        feed_forward(cfg.ffn, cfg.d_model, cfg.ff_width, cfg.dropout, cfg.bias),
        sublayer(cfg), sublayer(cfg), sublayer(cfg),
    )


class Sublayer(nn.Module):
    """A residual connection around one sublayer, with its norm placed before or after."""

    def __init__(self, norm: nn.Module, dropout: float, norm_first: bool):
        super().__init__()
        self.norm = norm
        self.dropout = nn.Dropout(dropout)
        self.norm_first = norm_first

    def forward(self, x: Tensor, fn, last: int | None = None) -> Tensor:
        """x (B, N, d) -> (B, N, d); with ``last``, fn maps its (B, N, d) input to the last
        positions' (B, last, d) and the residual keeps those positions alone."""
        residual = x if last is None else x[:, -last:]
        if self.norm_first:
            return residual + self.dropout(fn(self.norm(x)))
        return self.norm(residual + self.dropout(fn(x)))


class TransformerBlock(nn.Module):
    """Self-attention then feed-forward: the encoder layer, and GPT's layer under a causal mask.

    x (B, N, d_model) -> (B, N, d_model). ``transformer_block`` builds one from a config."""

    def __init__(self, self_attn: nn.Module, ffn: nn.Module, attn_sublayer: Sublayer,
                 ffn_sublayer: Sublayer):
        super().__init__()
        self.self_attn, self.ffn = self_attn, ffn
        self.attn_sublayer, self.ffn_sublayer = attn_sublayer, ffn_sublayer
        # Activation checkpointing (set by ``checkpoint_blocks``): training keeps only the
        # block's input and recomputes the rest in the backward pass.
        self.checkpoint = False

    def new_cache(self, batch: int, max_len: int, **kwargs):
        return self.self_attn.new_cache(batch, max_len, **kwargs)

    def forward(self, x: Tensor, *, mask=None, score_mod=None, positions=None, cache=None,
                last: int | None = None):
        """x (B, N, d_model) -> (B, N, d_model), or (B, last, d_model) with ``last``: the
        outputs of the last positions alone. Their queries still attend to every position,
        whose keys and values (and cache entries) are computed in full; the rest of the
        block runs on ``last`` rows (a model's last block, when only its last position's
        logits are read)."""
        if self.checkpoint and self.training and cache is None and torch.is_grad_enabled():
            # Non-reentrant: the mask objects pass as keyword arguments, and the RNG state is
            # replayed, so dropout draws the same units in the recomputation.
            return checkpoint(self._forward, x, mask=mask, score_mod=score_mod,
                              positions=positions, last=last, use_reentrant=False)
        return self._forward(x, mask=mask, score_mod=score_mod, positions=positions,
                             cache=cache, last=last)

    def _forward(self, x: Tensor, *, mask=None, score_mod=None, positions=None, cache=None,
                 last=None):
        kwargs = dict(mask=mask, score_mod=score_mod, positions=positions, cache=cache)

        def attend(h: Tensor) -> Tensor:
            if last is None:
                return self.self_attn(h, **kwargs)
            attn = self.self_attn
            if isinstance(attn, MultiHeadAttention) and not attn.observed:
                # The last queries against every key: the other queries' work is skipped.
                return attn(h[:, -last:], h, **kwargs)
            # Other kinds take a memory, not keys; a captured layer's maps keep every query.
            return attn(h, **kwargs)[:, -last:]

        return self.ffn_sublayer(self.attn_sublayer(x, attend, last), self.ffn)


class DecoderBlock(nn.Module):
    """Masked self-attention, attention over the encoder memory, then feed-forward.

    x (B, T, d_model), memory (B, S, d_model) -> (B, T, d_model). ``cache`` is a pair
    (self-attention cache, cross-attention cache) from ``new_cache``. ``decoder_block``
    builds one from a config."""

    def __init__(self, self_attn: nn.Module, cross_attn: nn.Module, ffn: nn.Module,
                 attn_sublayer: Sublayer, cross_sublayer: Sublayer, ffn_sublayer: Sublayer):
        super().__init__()
        self.self_attn, self.cross_attn, self.ffn = self_attn, cross_attn, ffn
        self.attn_sublayer, self.cross_sublayer = attn_sublayer, cross_sublayer
        self.ffn_sublayer = ffn_sublayer

    def new_cache(self, batch: int, max_len: int, memory_len: int, **kwargs):
        return (
            self.self_attn.new_cache(batch, max_len, **kwargs),
            self.cross_attn.new_cache(batch, memory_len, **kwargs),
        )

    def forward(
        self, x: Tensor, memory: Tensor | None, *, mask=None, memory_mask=None, score_mod=None,
        positions=None, cache=None,
    ):
        self_cache, cross_cache = (None, None) if cache is None else cache
        x = self.attn_sublayer(
            x, lambda h: self.self_attn(
                h, mask=mask, score_mod=score_mod, positions=positions, cache=self_cache
            ),
        )
        x = self.cross_sublayer(
            x, lambda h: self.cross_attn(h, memory, mask=memory_mask, cache=cross_cache)
        )
        return self.ffn_sublayer(x, self.ffn)


def checkpoint_blocks(model: nn.Module, on: bool = True) -> int:
    """Turn activation checkpointing on (or off) in every ``TransformerBlock`` of ``model``:
    training then holds one (B, N, d_model) input per block instead of all its intermediate
    tensors, for about a third more compute. Returns the number of blocks changed."""
    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for block in blocks:
        block.checkpoint = on
    return len(blocks)
