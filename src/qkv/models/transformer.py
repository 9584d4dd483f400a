"""The encoder-decoder Transformer of "Attention Is All You Need" (Vaswani et al. 2017)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..core import causal, padding
from ..nn.blocks import decoder_block, norm_layer, transformer_block
from ..nn.hooks import HookedModel
from ..nn.linear import Linear
from ..nn.positions import PositionScheme, make_positions
from .common import check_ids, check_lengths, init_weights, key_mask, token_positions
from .configs import TransformerConfig
from .generation import ModelCache, decode, eval_mode, stepper
from .torch_transformer import transformer_from_torch


class Transformer(HookedModel, nn.Module):
    """Encoder stack over the source, decoder stack over the target attending to the encoder's
    memory, and a linear output to target-vocabulary logits."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = c = config
        b = c.block
        self.src_emb = nn.Embedding(c.src_vocab_size, b.d_model)
        self.tgt_emb = self.src_emb if c.share_embeddings else nn.Embedding(
            c.tgt_vocab_size, b.d_model
        )
        self.src_positions, self.tgt_positions = (
            make_positions(c.positions, d_model=b.d_model, n_head=b.n_head,
                           head_dim=b.head_dim, max_len=c.max_len, bidirectional=bidirectional)
            for bidirectional in (True, False)
        )
        self.drop = nn.Dropout(b.dropout)
        self.encoder = nn.ModuleList(
            transformer_block(b, self.src_positions.rotary(), c.max_len, depth=i)
            for i in range(c.n_encoder_layers)
        )
        self.decoder = nn.ModuleList(
            decoder_block(b, self.tgt_positions.rotary(), c.max_len, depth=i)
            for i in range(c.n_decoder_layers)
        )
        final = b.norm_first if c.final_norm is None else c.final_norm
        self.encoder_norm = norm_layer(b) if final else None
        self.decoder_norm = norm_layer(b) if final else None
        self.out_proj = Linear(b.d_model, c.tgt_vocab_size, bias=False)
        self.embedding_scale = math.sqrt(b.d_model) if c.scale_embeddings else None
        init_weights(self)
        for emb in {self.src_emb, self.tgt_emb}:
            # √d_model scaling then gives unit-variance embeddings, like the positions' scale.
            nn.init.normal_(emb.weight, 0.0, b.d_model**-0.5)
        if c.tie_output:
            self.out_proj.weight = self.tgt_emb.weight

    def _embed(self, ids: Tensor, emb: nn.Embedding, positions: PositionScheme,
               pos: Tensor) -> Tensor:
        x = emb(ids)
        if self.embedding_scale is not None:
            x = x * self.embedding_scale
        pe = positions.embed(pos)
        return self.drop(x if pe is None else x + pe.to(x.dtype))

    def source_keep(self, src: Tensor, src_lengths: Tensor | None = None) -> Tensor:
        """(B, S) bool: True for real source tokens (from lengths, else from pad_id)."""
        lengths = check_lengths("src_lengths", src_lengths, *src.shape)
        if lengths is None:
            return src != self.config.pad_id
        return torch.arange(src.shape[1], device=src.device) < lengths.to(src.device)[:, None]

    def encode(self, src: Tensor, src_lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """src (B, S) -> memory (B, S, d_model) and keep (B, S), True for real tokens."""
        check_ids("src", src, self.config.src_vocab_size)
        self.src_positions.check_length(src.shape[1])
        keep = self.source_keep(src, src_lengths)
        pos = torch.arange(src.shape[1], device=src.device)
        x = self._embed(src, self.src_emb, self.src_positions, pos)
        mask = key_mask(keep)
        score_mod = self.src_positions.score_mod()
        layer_positions = self.src_positions.for_layers(pos)
        for block in self.encoder:
            x = block(x, mask=mask, score_mod=score_mod, positions=layer_positions)
        return (x if self.encoder_norm is None else self.encoder_norm(x)), keep

    def decode(
        self, tgt: Tensor, memory: Tensor, keep: Tensor, *, tgt_lengths: Tensor | None = None,
        cache: ModelCache | None = None,
    ) -> Tensor:
        """tgt (B, T) target ids (starting with bos) -> logits (B, T, tgt_vocab_size).

        Target padding comes after the real tokens, so the causal mask already hides it from
        every real query; tgt_lengths additionally hides it from padded queries."""
        check_ids("tgt", tgt, self.config.tgt_vocab_size)
        offset = 0 if cache is None else cache.length
        self.tgt_positions.check_length(offset + tgt.shape[1])
        pos = token_positions(offset, tgt.shape[1], None, tgt.device)
        x = self._embed(tgt, self.tgt_emb, self.tgt_positions, pos)
        lengths = check_lengths("tgt_lengths", tgt_lengths, *tgt.shape)
        mask = causal() if lengths is None else causal() & padding(lengths)
        memory_mask = key_mask(keep)
        score_mod = self.tgt_positions.score_mod()
        layer_positions = self.tgt_positions.for_layers(pos)
        for i, block in enumerate(self.decoder):
            x = block(
                x, memory, mask=mask, memory_mask=memory_mask, score_mod=score_mod,
                positions=layer_positions, cache=None if cache is None else cache.layers[i],
            )
        if cache is not None:
            cache.length += tgt.shape[1]
        return self.out_proj(x if self.decoder_norm is None else self.decoder_norm(x))

    def forward(
        self, src: Tensor, tgt: Tensor, src_lengths: Tensor | None = None,
        tgt_lengths: Tensor | None = None,
    ) -> Tensor:
        """src (B, S), tgt (B, T) -> logits (B, T, tgt_vocab_size). Padding is given by the
        lengths, or else by pad_id."""
        memory, keep = self.encode(src, src_lengths)
        return self.decode(tgt, memory, keep, tgt_lengths=tgt_lengths)

    def new_cache(self, batch: int, max_len: int, memory_len: int) -> ModelCache:
        """Empty decoder caches: self-attention up to max_len, cross-attention memory_len."""
        return ModelCache([block.new_cache(batch, max_len, memory_len) for block in self.decoder])

    @torch.no_grad()
    def generate(
        self, src: Tensor, src_lengths: Tensor | None = None, max_new_tokens: int | None = None,
        *, bos_id: int | None = None, eos_id: int | None = None, beam_size: int = 1,
        length_penalty: float = 1.0, temperature: float = 0.0, top_k: int | None = None,
        top_p: float | None = None, use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Translate src (B, S) -> (B, T) target ids after bos, T <= max_new_tokens (default
        S + 50, the paper's limit). Greedy by default (temperature 0); beam_size > 1 runs
        beam search with GNMT length penalty exponent ``length_penalty`` (the paper: beam 4,
        0.6). Each row ends at its first eos_id; later positions hold pad_id."""
        c = self.config
        bos_id = c.bos_id if bos_id is None else bos_id
        eos_id = c.eos_id if eos_id is None else eos_id
        max_new_tokens = src.shape[1] + 50 if max_new_tokens is None else max_new_tokens
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
        self.tgt_positions.check_length(max_new_tokens)
        with eval_mode(self):
            memory, keep = self.encode(src, src_lengths)
            if beam_size > 1:
                memory = memory.repeat_interleave(beam_size, 0)
                keep = keep.repeat_interleave(beam_size, 0)
            first = src.new_full((memory.shape[0], 1), bos_id)
            cache = None
            if use_cache:
                cache = self.new_cache(memory.shape[0], max_new_tokens, memory.shape[1])
            step, reorder = stepper(lambda t, cc: self.decode(t, memory, keep, cache=cc), cache)
            new = decode(
                step, reorder, first, src.shape[0], max_new_tokens, beam_size=beam_size,
                length_penalty=length_penalty, temperature=temperature, top_k=top_k,
                top_p=top_p, eos_id=eos_id, generator=generator,
            )
        after_eos = (new == eos_id).long().cumsum(1) - (new == eos_id).long() > 0
        return new.masked_fill(after_eos, c.pad_id)

    @classmethod
    def from_torch(
        cls, m: nn.Transformer, src_embedding: nn.Embedding,
        tgt_embedding: nn.Embedding | None = None, output: nn.Linear | None = None, **config,
    ) -> Transformer:
        """Copy a ``torch.nn.Transformer`` plus its embeddings (tgt_embedding None: shared with
        the source) and output projection (None: tied to the target embedding). Extra keywords
        go to TransformerConfig (max_len, pad_id, positions, ...)."""
        return transformer_from_torch(cls, TransformerConfig, m, src_embedding, tgt_embedding,
                                      output, **config)

