"""An encoder-only model (BERT-style): bidirectional self-attention, pooled, then a head.

With ``num_classes=0`` there is no head: the model returns hidden states, and ``embed`` gives
pooled sentence vectors (how BERT-family checkpoints such as all-MiniLM-L6-v2 are used)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import sliding_window
from ..nn.blocks import BlockConfig, TransformerBlock
from ..nn.norms import make_norm
from ..nn.positions import Positions
from .common import check_config, check_ids, check_lengths, init_weights, key_mask

POOLINGS = ("mean", "cls", "first")


@dataclass
class EncoderConfig:
    """An encoder. pooling "mean" averages the real tokens; "cls" prepends a learned [CLS]
    vector and pools its output; "first" pools the first token's output (BERT's [CLS], which
    the tokenizer puts in the ids). ``num_classes`` 0: no head (forward returns hidden states).
    ``normalize``: ``embed`` returns unit vectors. ``type_vocab_size`` > 0 adds token-type
    (segment) embeddings and ``embed_norm`` a norm after the embeddings, as BERT has. Padding
    comes from ``lengths`` or else from ``pad_id`` (None: no padding). ``window``: local
    attention, each token sees the ``window`` tokens on either side (None: all tokens)."""

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
    type_vocab_size: int = 0
    embed_norm: bool = False
    normalize: bool = False

    def __post_init__(self):
        if not isinstance(self.num_classes, int) or self.num_classes < 0:
            raise ValueError(f"EncoderConfig: num_classes must be an int >= 0 (0: no head); "
                             f"got {self.num_classes!r}")
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
        self.type_emb = nn.Embedding(c.type_vocab_size, c.d_model) if c.type_vocab_size else None
        self.embed_norm = make_norm(c.norm, c.d_model, c.norm_eps, c.bias) if c.embed_norm else None
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
        self.head = nn.Linear(c.d_model, c.num_classes) if c.num_classes else None
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
        for block in self.blocks:
            x = block(x, mask=mask, score_mod=score_mod, positions=pos)
        return (x if self.norm is None else self.norm(x)), keep

    def pool(self, x: Tensor, keep: Tensor) -> Tensor:
        """Hidden states (B, N', d_model) and keep (B, N') -> one vector per row (B, d_model)."""
        if self.config.pooling in ("cls", "first"):
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
        from .pretrained import load_encoder

        return load_encoder(path)
