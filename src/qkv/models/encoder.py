"""An encoder-only model (BERT-style): bidirectional self-attention, pooled, then a head.

With ``num_classes=0`` there is no head: the model returns hidden states, and ``embed`` gives
pooled sentence vectors (how BERT-family checkpoints such as all-MiniLM-L6-v2 are used)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import sliding_window
from ..nn.blocks import norm_layer, transformer_block
from ..nn.hooks import HookedModel
from ..nn.linear import Linear
from ..nn.positions import make_positions
from .common import check_ids, check_lengths, init_weights, key_mask
from .configs import EncoderConfig
from .pretrained import encoder_from_pretrained


class Encoder(HookedModel, nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = c = config
        b, cls = c.block, c.pooling == "cls"
        self.tok_emb = nn.Embedding(c.vocab_size, b.d_model)
        self.type_emb = nn.Embedding(c.type_vocab_size, b.d_model) if c.type_vocab_size else None
        self.embed_norm = norm_layer(b) if c.embed_norm else None
        self.cls_token = nn.Parameter(torch.zeros(1, 1, b.d_model)) if cls else None
        self.positions = make_positions(
            c.positions, d_model=b.d_model, n_head=b.n_head, head_dim=b.head_dim,
            max_len=c.max_len + int(cls),
        )
        self.drop = nn.Dropout(b.dropout)
        self.blocks = nn.ModuleList(
            transformer_block(b, self.positions.rotary(), c.max_len, depth=i)
            for i in range(c.n_layer)
        )
        self.norm = norm_layer(b) if b.norm_first else None
        self.head = Linear(b.d_model, c.num_classes) if c.num_classes else None
        # "cls" and "first" pool the first position's output, "mean" the real tokens'.
        self.pool_first = c.pooling in ("cls", "first")
        init_weights(self)
        if cls:
            nn.init.normal_(self.cls_token, 0.0, 0.02)

    def features(
        self, ids: Tensor, lengths: Tensor | None = None, token_types: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """ids (B, N) -> hidden states (B, N', d_model) and keep (B, N') (N' = N + 1 with the
        [CLS] vector first). token_types (B, N): segment ids (default all 0)."""
        check_ids("ids", ids, self.config.vocab_size)
        b, n = ids.shape
        lengths = check_lengths("lengths", lengths, b, n)
        if lengths is not None:
            keep = torch.arange(n, device=ids.device) < lengths.to(ids.device)[:, None]
        elif self.config.pad_id is not None:
            keep = ids != self.config.pad_id
        else:
            keep = torch.ones_like(ids, dtype=torch.bool)
        x = self.tok_emb(ids)
        if self.type_emb is not None:
            x = x + self.type_emb(torch.zeros_like(ids) if token_types is None else token_types)
        if self.cls_token is not None:
            x = torch.cat((self.cls_token.expand(b, -1, -1).to(x.dtype), x), dim=1)
            keep = torch.cat((keep.new_ones(b, 1), keep), dim=1)
        self.positions.check_length(x.shape[1])
        pos = torch.arange(x.shape[1], device=ids.device)
        pe = self.positions.embed(pos)
        x = x if pe is None else x + pe.to(x.dtype)
        x = self.drop(x if self.embed_norm is None else self.embed_norm(x))
        mask, score_mod = key_mask(keep), self.positions.score_mod()
        if self.config.window is not None:
            local = sliding_window(self.config.window, self.config.window)
            mask = local if mask is None else local & mask
        layer_positions = self.positions.for_layers(pos)
        for block in self.blocks:
            x = block(x, mask=mask, score_mod=score_mod, positions=layer_positions)
        return (x if self.norm is None else self.norm(x)), keep

    def pool(self, x: Tensor, keep: Tensor) -> Tensor:
        """Hidden states (B, N', d_model) and keep (B, N') -> one vector per row (B, d_model)."""
        if self.pool_first:
            return x[:, 0]
        weights = keep.to(x.dtype).unsqueeze(-1)
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)

    def embed(
        self, ids: Tensor, lengths: Tensor | None = None, token_types: Tensor | None = None
    ) -> Tensor:
        """ids (B, N) -> sentence embeddings (B, d_model): pooled, unit length if
        ``config.normalize``."""
        pooled = self.pool(*self.features(ids, lengths, token_types))
        return F.normalize(pooled, dim=-1) if self.config.normalize else pooled

    def forward(
        self, ids: Tensor, lengths: Tensor | None = None, token_types: Tensor | None = None
    ) -> Tensor:
        """ids (B, N) token ids, lengths (B,) optional -> logits (B, num_classes), or the hidden
        states (B, N', d_model) when the model has no head (num_classes 0)."""
        x, keep = self.features(ids, lengths, token_types)
        if self.head is None:
            return x
        return self.head(self.pool(x, keep))

    @classmethod
    def from_pretrained(cls, path) -> Encoder:
        """Load a BERT-family Hugging Face directory (config.json + model.safetensors), or the
        short name ``minilm``; sentence-transformers pooling settings in the directory set
        ``pooling`` and ``normalize``."""
        return encoder_from_pretrained(cls, path)
