"""Differential attention (Ye et al., "Differential Transformer", ICLR 2025).

Each head subtracts a second softmax map from a first, cancelling the attention that both
give to irrelevant context: out_h = (A_2h − λ A_2h+1) V_h. The layout is the reference
implementation's (microsoft/unilm, ``Diff-Transformer/multihead_diffattn.py``): q and k hold
2·n_head heads of head_dim = d_model / n_head / 2, v holds n_head heads of 2·head_dim.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..core.scores import ScoreMod, as_score_mod
from ..core.similarity import get_similarity
from ..core.weighting import as_weighting
from ..engines.api import attention
from .attention import KVCache
from .forget_gate import check_no_forget_gate
from .heads import merge_heads, split_heads
from .linear import Linear
from .norms import RMSNorm
from .positions import RotaryEmbedding, Rotation


def lambda_init(depth: int) -> float:
    """λ_init = 0.8 − 0.6·exp(−0.3·depth), depth the layer's 0-based index."""
    return 0.8 - 0.6 * math.exp(-0.3 * depth)


class PairedHeads(ScoreMod):
    """A modifier written for n_head heads, applied to the 2·n_head query heads: heads 2h and
    2h+1 (the two maps of head h) both read head h, so ALiBi slopes and T5 tables of the
    stack's n_head heads apply to each map."""

    def __init__(self, mod: ScoreMod):
        self.mod = mod

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        return self.mod(score, b, h // 2, q_idx, kv_idx, offset)

    def tensors(self):
        return self.mod.tensors()

    def check_heads(self, heads: int) -> None:
        self.mod.check_heads(heads // 2)

    def __repr__(self) -> str:
        return f"paired({self.mod!r})"


def every_other_frequency(rotation: Rotation) -> Rotation:
    """The rotation of head_dim D/2 from one of D with the same base: RoPE's frequencies
    base^(−2i/(D/2)) are every other one of base^(−2i/D). cos and sin (..., D) are two
    halves of D/2 frequencies each; the result's (..., D/2)."""
    def halve(x: Tensor) -> Tensor:
        half = x.shape[-1] // 2
        return torch.cat((x[..., :half:2], x[..., half::2]), dim=-1)
    return Rotation(halve(rotation.cos), halve(rotation.sin))


class DifferentialAttention(nn.Module):
    """DiffAttn_h(X) = (softmax(Q_2h K_2hᵀ/√d) − λ softmax(Q_2h+1 K_2h+1ᵀ/√d)) V_h, each head
    through RMSNorm over 2·head_dim (``subln``) times (1 − λ_init), then W^O.

    λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, shared by the heads, with
    λ_init = 0.8 − 0.6·exp(−0.3·depth).

    Args:
        d_model: width of the input and output; a multiple of 2·n_head.
        n_head: differential heads H (each has two maps: the paper halves a Transformer's
            heads); q and k have 2H heads of head_dim = d_model / H / 2, v has H heads of
            2·head_dim.
        depth: the layer's 0-based index in its stack.
        n_kv_head: key/value heads Hkv (grouped queries, as the reference repeats them:
            query head i of the 2H reads key head i // (H / Hkv)); H % Hkv == 0.
        bias: bias in the four projections.
        rope: a RotaryEmbedding for head_dim, or the stack's for 2·head_dim (d_model /
            n_head), whose every other frequency is head_dim's rotation with the same base
            (``every_other_frequency``); self-attention only.
        dropout: dropout on each map's weights, in training mode only.
        is_cross: keys and values from a memory (encoder-decoder attention).

    Both maps come from one ``qkv.attention`` call over the 2H query heads, with each value
    head repeated for the pair of key heads that read it: the engines' fused, O(N)-memory
    route, giving A_2h V_h and A_2h+1 V_h, whose difference is taken after. Masks apply to
    every map alike; score modifiers written for H heads (ALiBi, T5 bias) read head h for
    both maps of head h (``PairedHeads``).
    """

    def __init__(self, d_model: int, n_head: int, *, depth: int, n_kv_head: int | None = None,
                 bias: bool = False, rope: RotaryEmbedding | None = None, dropout: float = 0.0,
                 is_cross: bool = False):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_head <= 0 or n_kv_head <= 0:
            raise ValueError(f"n_head and n_kv_head must be positive; got {n_head}, {n_kv_head}")
        if d_model % (2 * n_head):
            raise ValueError(f"d_model={d_model} must be divisible by 2 * n_head={2 * n_head} "
                             f"(q and k hold two heads per differential head)")
        if n_head % n_kv_head:
            raise ValueError(f"n_head={n_head} must be divisible by n_kv_head={n_kv_head}")
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
            raise ValueError(f"depth must be the layer's 0-based index, an int >= 0; got "
                             f"{depth!r}")
        if rope is not None and is_cross:
            raise ValueError("rope applies to self-attention only, not to is_cross=True")
        self.d_model, self.n_head, self.n_kv_head = d_model, n_head, n_kv_head
        self.head_dim = d = d_model // n_head // 2
        if rope is not None and rope.inv_freq.numel() not in (d // 2, d):
            raise ValueError(f"rope must rotate head_dim={d} or 2 * head_dim={2 * d}; got a "
                             f"RotaryEmbedding of {2 * rope.inv_freq.numel()}")
        if rope is not None and d % 2:
            raise ValueError(f"rope needs an even head_dim; d_model / n_head / 2 = {d}")
        self.depth, self.lambda_init = depth, lambda_init(depth)
        self.rope, self.is_cross, self.dropout = rope, is_cross, dropout
        self.q_proj = Linear(d_model, 2 * n_head * d, bias=bias)
        self.k_proj = Linear(d_model, 2 * n_kv_head * d, bias=bias)
        self.v_proj = Linear(d_model, n_kv_head * 2 * d, bias=bias)
        self.out_proj = Linear(n_head * 2 * d, d_model, bias=bias)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.randn(d) * 0.1))
        self.subln = RMSNorm(2 * d, eps=1e-5)

    def new_cache(self, batch: int, max_len: int, *, device=None, dtype=None) -> KVCache:
        """An empty cache for ``batch`` rows and up to ``max_len`` key positions: keys
        (B, 2·Hkv, max_len, head_dim) and values (B, 2·Hkv, max_len, 2·head_dim), each value
        head stored for both key heads that read it, as the attention call takes them."""
        weight = self.k_proj.weight
        activations = getattr(self.k_proj, "activation_dtype", weight.dtype)
        return KVCache(batch, 2 * self.n_kv_head, max_len, self.head_dim, 2 * self.head_dim,
                       device=device or weight.device, dtype=dtype or activations)

    def lambda_full(self) -> Tensor:
        """λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, a 0-d tensor."""
        return (torch.exp(self.lambda_q1 @ self.lambda_k1)
                - torch.exp(self.lambda_q2 @ self.lambda_k2) + self.lambda_init)

    def _rotation(self, positions) -> Rotation:
        rotation = positions if isinstance(positions, Rotation) else \
            self.rope.rotation(positions)
        if rotation.cos.shape[-1] == 2 * self.head_dim:
            return every_other_frequency(rotation)
        if rotation.cos.shape[-1] != self.head_dim:
            raise ValueError(f"positions' rotation must be of head_dim={self.head_dim} or "
                             f"2 * head_dim; got {rotation.cos.shape[-1]}")
        return rotation

    def forward(self, x: Tensor, memory: Tensor | None = None, *, mask=None, score_mod=None,
                positions=None, cache: KVCache | None = None, return_weights: bool = False):
        """x (B, N, d_model); memory (B, M, d_model) for cross-attention (None on later cached
        calls); positions (N,) or (B, N), or their Rotation, for rope (default: the cache's
        length onwards). Returns out (B, N, d_model), or (out, the difference maps
        A_2h − λ A_2h+1 (B, H, N, Nk)) with ``return_weights``."""
        if x.dim() != 3 or x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape (B, N, {self.d_model}); got {tuple(x.shape)}")
        q = split_heads(self.q_proj(x), 2 * self.n_head)
        if self.is_cross and cache is not None and cache.length > 0:
            k, v = cache.cached()
        else:
            if self.is_cross and memory is None:
                raise ValueError("cross-attention needs memory on its first call")
            source = memory if self.is_cross else x
            k = split_heads(self.k_proj(source), 2 * self.n_kv_head)
            # Key heads 2j and 2j+1 both read value head j.
            v = split_heads(self.v_proj(source), self.n_kv_head).repeat_interleave(2, dim=1)
            if self.rope is not None:
                if positions is None:
                    start = 0 if cache is None else cache.length
                    positions = torch.arange(start, start + k.shape[2], device=x.device)
                rotation = self._rotation(positions)
                q, k = self.rope(q, rotation), self.rope(k, rotation)
            if cache is not None:
                k, v = cache.append(k, v)
        score_mod = as_score_mod(score_mod)
        out, weights = self.attend(
            q, k, v, mask=mask, score_mod=None if score_mod is None else PairedHeads(score_mod),
            return_weights=return_weights, dropout_p=self.dropout if self.training else 0.0)
        lam = self.lambda_full().to(out.dtype)
        out = out[:, 0::2] - lam * out[:, 1::2]                        # (B, H, N, 2·head_dim)
        out = self.subln(out) * (1 - self.lambda_init)
        out = self.out_proj(merge_heads(out))
        if not return_weights:
            return out
        return out, weights[:, 0::2] - lam.to(weights.dtype) * weights[:, 1::2]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
        """The layer's one call to ``qkv.attention``: q (B, 2H, Nq, D), k (B, 2Hkv, Nk, D),
        v (B, 2Hkv, Nk, 2D). Returns out (B, 2H, Nq, 2D), the two maps' outputs of each head
        interleaved, and their weights (B, 2H, Nq, Nk) when ``return_weights``, else None."""
        result = attention(q, k, v, **kwargs)
        return result if kwargs["return_weights"] else (result, None)


def differential_kind(*, d_model, n_head, n_kv_head, bias, dropout, similarity, weighting, rope,
                      is_cross, depth, forget_gate) -> DifferentialAttention:
    """The builder of attention kind "differential" (see ``qkv.nn.kinds``): the paper's two
    softmax maps of dot products."""
    if get_similarity(similarity) is not get_similarity("dot"):
        raise ValueError(f"attention='differential' subtracts two maps of dot products; "
                         f"similarity must be 'dot'; got {similarity!r}")
    if not as_weighting(weighting).is_softmax:
        raise ValueError(f"attention='differential' subtracts two softmax maps; weighting must "
                         f"be 'softmax'; got {weighting!r}")
    check_no_forget_gate(forget_gate, "differential")
    return DifferentialAttention(d_model, n_head, depth=depth, n_kv_head=n_kv_head, bias=bias,
                                 rope=rope, dropout=dropout, is_cross=is_cross)
