"""GPT: a decoder-only causal language model (Radford et al. 2018/2019)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core import causal, padding, sliding_window
from ..distributed.context import active as active_context_parallel
from ..nn.blocks import norm_layer, transformer_block
from ..nn.hooks import HookedModel
from ..nn.linear import Linear
from ..nn.positions import make_positions
from .common import (
    check_ids,
    check_lengths,
    init_weights,
    left_align,
    place_after,
    token_positions,
)
from .configs import GPTConfig
from .generation import ModelCache, decode, eval_mode, stepper
from .pretrained import gpt_from_pretrained


class GPT(HookedModel, nn.Module):
    """Token embedding, positions, pre-norm causal blocks, final norm, LM head (tied)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = c = config
        b = c.block
        self.tok_emb = nn.Embedding(c.vocab_size, b.d_model)
        self.positions = make_positions(
            c.positions, d_model=b.d_model, n_head=b.n_head, head_dim=b.head_dim,
            max_len=c.block_size, bidirectional=False,
        )
        self.drop = nn.Dropout(b.dropout)
        self.blocks = nn.ModuleList(
            transformer_block(b, self.positions.rotary(), c.block_size, depth=i)
            for i in range(c.n_layer)
        )
        self.norm = norm_layer(b)
        self.lm_head = Linear(b.d_model, c.vocab_size, bias=False)
        init_weights(self)
        if c.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def new_cache(self, batch: int, max_len: int) -> ModelCache:
        """An empty KV cache (one per layer) for ``batch`` rows and ``max_len`` positions."""
        return ModelCache([block.new_cache(batch, max_len) for block in self.blocks])

    def forward(
        self, idx: Tensor, *, left_pad: Tensor | None = None, cache: ModelCache | None = None,
        last_only: bool = False, head: bool = True,
    ) -> Tensor:
        """idx (B, N) token ids -> logits (B, N, V), or (B, 1, V) with ``last_only``; with
        ``head=False`` the final norm's output (B, N, D) instead, for a loss that applies the
        head itself (``qkv.distributed.vocab.ShardedHead.cross_entropy_sum``).

        left_pad (B,): rows start with that many padding tokens, which no query attends to;
        positions count from each row's first real token. cache: continue after the
        ``cache.length`` positions it holds (incremental decoding). last_only: the logits of
        the last position alone, which is what generation reads (over a long prompt, the LM
        head on every position is the largest single matmul of the prefill)."""
        check_ids("idx", idx, self.config.vocab_size)
        offset = 0 if cache is None else cache.length
        split = active_context_parallel()
        if split is not None:
            # idx is this rank's shard of each sequence (qkv.distributed.context_parallel).
            if cache is not None or left_pad is not None:
                raise ValueError("GPT under context parallelism takes whole shards: no cache "
                                 "and no left_pad")
            self.positions.check_length(idx.shape[1] * split.world)
            positions = split.positions(idx.shape[1], idx.device)
        else:
            self.positions.check_length(offset + idx.shape[1])
            positions = token_positions(offset, idx.shape[1], left_pad, idx.device)
        x = self.tok_emb(idx)
        pe = self.positions.embed(positions)
        if pe is not None:
            x = x + pe.to(x.dtype)
        x = self.drop(x)
        mask = causal() if self.config.window is None else sliding_window(self.config.window)
        if left_pad is not None:
            mask = mask & ~padding(left_pad)
        score_mod = self.positions.score_mod()
        layer_positions = self.positions.for_layers(positions)
        # With last_only, the last block computes its last position alone (its keys and
        # values still cover every position): no other output of that block is read.
        last = 1 if last_only and split is None else None
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[i]
            x = block(x, mask=mask, score_mod=score_mod, positions=layer_positions,
                      cache=layer_cache, last=last if i == len(self.blocks) - 1 else None)
        if cache is not None:
            cache.length += idx.shape[1]
        x = self.norm(x[:, -1:] if last_only else x)
        return self.lm_head(x) if head else x

    @torch.no_grad()
    def generate(
        self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0,
        top_k: int | None = None, top_p: float | None = None, *, lengths: Tensor | None = None,
        eos_id: int | None = None, pad_id: int = 0, beam_size: int = 1,
        length_penalty: float = 1.0, use_cache: bool = True,
        generator: torch.Generator | None = None, on_token=None,
    ) -> Tensor:
        """Continue prompts idx (B, N) by up to max_new_tokens tokens -> (B, N + T).

        temperature 0 is greedy; top_k / top_p filter before sampling; beam_size > 1 runs beam
        search (GNMT length penalty, exponent ``length_penalty``). Prompts of different
        lengths come right-padded with ``lengths`` (B,); each output row is its prompt, then
        its continuation, then pad_id. Rows that emit eos_id are filled with eos_id; the loop
        stops when all rows have. ``on_token(token (B,))`` is called with each step's tokens
        as they are chosen (streaming; not with beam search). The model runs in eval mode for
        the call."""
        check_ids("idx", idx, self.config.vocab_size)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0; got {max_new_tokens}")
        b, n = idx.shape
        lengths = check_lengths("lengths", lengths, b, n)
        full = lengths is None
        lengths = torch.full((b,), n, device=idx.device) if full else lengths.to(idx.device)
        self.positions.check_length(n + max_new_tokens)
        aligned, left_pad = left_align(idx, lengths, pad_id)
        left_pad = None if full else left_pad
        if beam_size > 1:
            aligned = aligned.repeat_interleave(beam_size, 0)
            left_pad = None if left_pad is None else left_pad.repeat_interleave(beam_size, 0)
        cache = self.new_cache(aligned.shape[0], n + max_new_tokens) if use_cache else None
        step, reorder = stepper(
            lambda tokens, c: self(tokens, left_pad=left_pad, cache=c, last_only=True), cache
        )
        with eval_mode(self):
            new = decode(
                step, reorder, aligned, b, max_new_tokens, beam_size=beam_size,
                length_penalty=length_penalty, temperature=temperature, top_k=top_k,
                top_p=top_p, eos_id=eos_id, generator=generator, on_token=on_token,
            )
        return place_after(idx, lengths, new, pad_id)

    @classmethod
    def from_pretrained(cls, path) -> GPT:
        """Load a Hugging Face GPT-2 or LLaMA-family directory (config.json +
        model.safetensors, sharded too), a LLaMA-architecture ``.gguf`` file, or the short
        name ``smollm2``. Reads safetensors and GGUF only; pickle checkpoints are refused."""
        return gpt_from_pretrained(cls, path)
