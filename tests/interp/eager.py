"""A hand-written eager GPT forward from a qkv GPT's weights (learned positions, pre-norm
LayerNorm, GELU MLP, causal softmax or sigmoid attention), in float64, where every named
activation can be read or replaced: what each hook and intervention is checked against."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _norm(x: Tensor, norm) -> Tensor:
    return F.layer_norm(x, (x.shape[-1],), norm.weight.double(), norm.bias.double(), norm.eps)


def _linear(x: Tensor, layer) -> Tensor:
    bias = None if layer.bias is None else layer.bias.double()
    return x @ layer.weight.double().T + (0 if bias is None else bias)


def eager_gpt(model, idx: Tensor, edits: dict | None = None, seen: dict | None = None,
              sigmoid: bool = False) -> Tensor:
    """Logits (B, N, V) in float64. ``edits``: {(layer, short): fn(tensor) -> tensor}, with
    short one of q, k, v (B, N, H, D), attn_scores, pattern (B, H, N, N), z (B, N, H, D),
    result (B, N, H, d_model), resid_pre, resid_post (B, N, d); ``seen`` collects every
    activation under the same keys (after its edit). ``sigmoid``: weights
    sigmoid(s - log block_size) instead of softmax."""
    edits, seen = edits or {}, {} if seen is None else seen

    def at(layer, short, t):
        fn = edits.get((layer, short))
        t = t if fn is None else fn(t)
        seen[(layer, short)] = t
        return t

    n = idx.shape[1]
    x = model.tok_emb.weight.double()[idx] + model.positions.table.weight.double()[:n]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for i, block in enumerate(model.blocks):
        x = at(i, "resid_pre", x)
        attn = block.self_attn
        h = _norm(x, block.attn_sublayer.norm)
        heads = attn.n_head
        q, k, v = (at(i, s, _linear(h, proj).unflatten(-1, (heads, -1)))
                   for s, proj in (("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)))
        s = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = at(i, "attn_scores", s.masked_fill(~causal, float("-inf")))
        if sigmoid:
            w = torch.sigmoid(s - math.log(model.config.block_size))
        else:
            w = torch.softmax(s, dim=-1)
        w = at(i, "pattern", w.masked_fill(~causal, 0.0))
        z = at(i, "z", (w @ v.transpose(1, 2)).transpose(1, 2))
        wo = attn.out_proj.weight.double().unflatten(1, (heads, -1))
        result = at(i, "result", torch.einsum("bnhd,mhd->bnhm", z, wo))
        x = x + result.sum(2) + attn.out_proj.bias.double()
        ffn = block.ffn
        x = x + _linear(F.gelu(_linear(_norm(x, block.ffn_sublayer.norm), ffn.up_proj)),
                        ffn.down_proj)
        x = at(i, "resid_post", x)
    return _linear(_norm(x, model.norm), model.lm_head)
