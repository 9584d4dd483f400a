"""An encoder-only classifier (BERT-style): bidirectional self-attention, pooled, then a head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention import sliding_window
from ..nn.blocks import BlockConfig, TransformerBlock
from ..nn.norms import make_norm
from ..nn.positions import Positions
from .common import check_config, check_ids, check_lengths, init_weights, key_mask

POOLINGS = ("mean", "cls")


@dataclass
class EncoderConfig:
    """An encoder classifier. pooling "mean" averages the real tokens; "cls" prepends a learned
    [CLS] vector and classifies its output. Padding comes from ``lengths`` or else from
    ``pad_id`` (None: no padding). ``window``: local attention, each token sees the ``window``
    tokens on either side (None: all tokens)."""

    vocab_size: int
    num_classes: int
    max_len: int
    n_layer: int
    n_head: int
    d_model: int
    pooling: str = "mean"
    n_kv_head: int | None = None
    d_ff: int | None = None
    dropout: float = 0.1
    positions: str = "learned"
    norm: str = "layernorm"
    norm_first: bool = True
    ffn: str = "gelu"
    similarity: str = "dot"
    attention: str = "softmax"
    bias: bool = True
    norm_eps: float = 1e-5
    pad_id: int | None = 0
    window: int | None = None

    def __post_init__(self):
        check_config(
            "EncoderConfig", d_model=self.d_model, n_head=self.n_head, n_kv_head=self.n_kv_head,
            positions=self.positions, attention=self.attention,
        )
        if self.pooling not in POOLINGS:
            raise ValueError(f"EncoderConfig: pooling must be one of {POOLINGS}; got "
                             f"{self.pooling!r}")

    def block(self) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model, n_head=self.n_head, d_ff=self.d_ff or 4 * self.d_model,
            n_kv_head=self.n_kv_head, dropout=self.dropout, norm=self.norm,
            norm_eps=self.norm_eps, norm_first=self.norm_first, ffn=self.ffn, bias=self.bias,
            similarity=self.similarity, attention=self.attention,
        )


class Encoder(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = c = config
        cls = c.pooling == "cls"
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model)) if cls else None
        self.positions = Positions(
            c.positions, d_model=c.d_model, n_head=c.n_head, head_dim=c.d_model // c.n_head,
            max_len=c.max_len + int(cls),
        )
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(c.block(), i, self.positions.rope) for i in range(c.n_layer)
        )
        self.norm = make_norm(c.norm, c.d_model, c.norm_eps, c.bias) if c.norm_first else None
        self.head = nn.Linear(c.d_model, c.num_classes)
        init_weights(self)
        if cls:
            nn.init.normal_(self.cls_token, 0.0, 0.02)

    def features(self, ids: Tensor, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """ids (B, N) -> hidden states (B, N', d_model) and keep (B, N') (N' = N + 1 with the
        [CLS] vector first)."""
        check_ids("ids", ids)
        b, n = ids.shape
        lengths = check_lengths("lengths", lengths, b, n)
        if lengths is not None:
            keep = torch.arange(n, device=ids.device) < lengths.to(ids.device)[:, None]
        elif self.config.pad_id is not None:
            keep = ids != self.config.pad_id
        else:
            keep = torch.ones_like(ids, dtype=torch.bool)
        x = self.tok_emb(ids)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(b, -1, -1).to(x.dtype), x), dim=1)
            keep = torch.cat((keep.new_ones(b, 1), keep), dim=1)
        self.positions.check_length(x.shape[1])
        pos = torch.arange(x.shape[1], device=ids.device)
        pe = self.positions.embed(pos)
        x = self.drop(x if pe is None else x + pe.to(x.dtype))
        mask, score_mod = key_mask(keep), self.positions.score_mod()
        if self.config.window is not None:
            local = sliding_window(self.config.window, self.config.window)
            mask = local if mask is None else local & mask
        for block in self.blocks:
            x = block(x, mask=mask, score_mod=score_mod, positions=pos)
        return (x if self.norm is None else self.norm(x)), keep

    def forward(self, ids: Tensor, lengths: Tensor | None = None) -> Tensor:
        """ids (B, N) token ids, lengths (B,) optional -> logits (B, num_classes)."""
        x, keep = self.features(ids, lengths)
        if self.cls_token is not None:
            return self.head(x[:, 0])
        weights = keep.to(x.dtype).unsqueeze(-1)
        pooled = (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        return self.head(pooled)
