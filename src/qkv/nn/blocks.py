"""Transformer blocks: attention and feed-forward sublayers with residuals, norms and dropout.

Post-norm (the paper's): x = Norm(x + Dropout(Sublayer(x))).
Pre-norm:                x = x + Dropout(Sublayer(Norm(x))).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .feedforward import FeedForward
from .kinds import build_attention
from .norms import make_norm
from .positions import RotaryEmbedding


@dataclass
class BlockConfig:
    """Everything one block needs; models build it from their own config."""

    d_model: int
    n_head: int
    d_ff: int
    n_kv_head: int | None = None
    dropout: float = 0.0
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    norm_first: bool = False
    ffn: str = "relu"
    bias: bool = True
    similarity: str = "dot"
    attention: str = "softmax"


def _attention(cfg: BlockConfig, rope, is_cross: bool, layer_index: int) -> nn.Module:
    return build_attention(
        cfg.attention, d_model=cfg.d_model, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
        bias=cfg.bias, dropout=cfg.dropout, similarity=cfg.similarity, rope=rope,
        is_cross=is_cross, layer_index=layer_index,
    )


class Sublayer(nn.Module):
    """A residual connection around one sublayer, with its norm placed before or after."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.norm = make_norm(cfg.norm, cfg.d_model, cfg.norm_eps, cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.norm_first = cfg.norm_first

    def forward(self, x: Tensor, fn) -> Tensor:
        if self.norm_first:
            return x + self.dropout(fn(self.norm(x)))
        return self.norm(x + self.dropout(fn(x)))


class TransformerBlock(nn.Module):
    """Self-attention then feed-forward: the encoder layer, and GPT's layer under a causal mask.

    x (B, N, d_model) -> (B, N, d_model)."""

    def __init__(self, cfg: BlockConfig, layer_index: int, rope: RotaryEmbedding | None = None):
        super().__init__()
        self.self_attn = _attention(cfg, rope, False, layer_index)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.ffn, cfg.dropout, cfg.bias)
        self.attn_sublayer = Sublayer(cfg)
        self.ffn_sublayer = Sublayer(cfg)
        # Activation checkpointing (set by ``checkpoint_blocks``): training keeps only the
        # block's input and recomputes the rest in the backward pass.
        self.checkpoint = False

    def new_cache(self, batch: int, max_len: int, **kwargs):
        return self.self_attn.new_cache(batch, max_len, **kwargs)

    def forward(self, x: Tensor, *, mask=None, score_mod=None, positions=None, cache=None):
        if self.checkpoint and self.training and cache is None and torch.is_grad_enabled():
            # Non-reentrant: the mask objects pass as keyword arguments, and the RNG state is
            # replayed, so dropout draws the same units in the recomputation.
            return checkpoint(self._forward, x, mask=mask, score_mod=score_mod,
                              positions=positions, use_reentrant=False)
        return self._forward(x, mask=mask, score_mod=score_mod, positions=positions,
                             cache=cache)

    def _forward(self, x: Tensor, *, mask=None, score_mod=None, positions=None, cache=None):
        x = self.attn_sublayer(
            x, lambda h: self.self_attn(
                h, mask=mask, score_mod=score_mod, positions=positions, cache=cache
            ),
        )
        return self.ffn_sublayer(x, self.ffn)


class DecoderBlock(nn.Module):
    """Masked self-attention, attention over the encoder memory, then feed-forward.

    x (B, T, d_model), memory (B, S, d_model) -> (B, T, d_model). ``cache`` is a pair
    (self-attention cache, cross-attention cache) from ``new_cache``."""

    def __init__(self, cfg: BlockConfig, layer_index: int, rope: RotaryEmbedding | None = None):
        super().__init__()
        self.self_attn = _attention(cfg, rope, False, layer_index)
        self.cross_attn = _attention(cfg, None, True, layer_index)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.ffn, cfg.dropout, cfg.bias)
        self.attn_sublayer = Sublayer(cfg)
        self.cross_sublayer = Sublayer(cfg)
        self.ffn_sublayer = Sublayer(cfg)

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
