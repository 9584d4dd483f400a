"""``Retention``: RetNet's multi-scale retention as a block's attention kind.

    MSR(X) = (swish(X W_G) ⊙ GroupNorm(retention_h(X W_Q, X W_K, X W_V; γ_h))) W_O

The kind ``attention="retention"`` of every model config (see ``qkv.nn.kinds``).
Training runs the chunkwise form; generation carries the recurrent state (B, H, D, D) in a
``StateCache``, O(1) per token. Under ``qkv.causal()`` retention is causal; without it
(encoders) it is bidirectional, γ^|n-m|.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core.linear import check_positive_int, no_weights_error
from ..core.retention import NO_WEIGHTS_HINT, retention, retention_decays
from .forget_gate import check_no_forget_gate
from .heads import split_heads
from .linear import Linear
from .linear_attention import StateCache, causal_and_key_mask, check_softmax_weighting
from .positions import RotaryEmbedding


class Retention(nn.Module):
    """Multi-scale retention with per-head decays γ_h = 1 - 2^(-5-h).

    Args:
        d_model: width of the input and output; head_dim = d_model / n_head.
        n_head, n_kv_head: query heads H (one decay each) and key/value heads Hkv.
        bias: bias in the projections.
        chunk_size: chunk length of the chunkwise form used for whole sequences.
        norm_eps: epsilon of the per-head group norm.
        rope: a shared RotaryEmbedding applied to q and k (RetNet's xPos rotation, without
            its extra decay, which γ already provides).

    Masks: ``qkv.causal()`` and key padding masks. Retention is self-attention over a
    sequence: ``is_cross=True`` is refused. There are no attention weights;
    ``decay_matrix`` and ``retention_scores`` in ``qkv.core.retention`` show what
    mixes tokens instead.
    """

    def __init__(
        self, d_model: int, n_head: int, *, n_kv_head: int | None = None, bias: bool = True,
        chunk_size: int = 64, norm_eps: float = 1e-5, rope: RotaryEmbedding | None = None,
        is_cross: bool = False,
    ):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_head <= 0 or n_kv_head <= 0 or d_model % n_head or n_head % n_kv_head:
            raise ValueError(
                f"need d_model % n_head == 0 and n_head % n_kv_head == 0 (all positive); got "
                f"d_model={d_model}, n_head={n_head}, n_kv_head={n_kv_head}"
            )
        if is_cross:
            raise ValueError(
                "retention is causal self-attention over one sequence; it has no "
                "cross-attention form (is_cross=True); use attention='multihead' or 'linear'"
            )
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d_model // n_head
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        self.rope, self.is_cross = rope, is_cross
        self.q_proj = Linear(d_model, d_model, bias=bias)
        self.k_proj = Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.v_proj = Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.gate_proj = Linear(d_model, d_model, bias=bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)
        self.group_norm = nn.GroupNorm(n_head, d_model, eps=norm_eps)
        self.register_buffer("gamma", retention_decays(n_head), persistent=False)

    def new_cache(self, batch: int, max_len: int, *, device=None, dtype=None) -> StateCache:
        """An empty state; its size does not grow with the sequence, so max_len is not used."""
        return StateCache()

    def forward(
        self, x: Tensor, memory: Tensor | None = None, *, mask=None, score_mod=None,
        positions: Tensor | None = None, cache: StateCache | None = None,
        return_weights: bool = False,
    ) -> Tensor:
        """x (B, N, d_model) -> (B, N, d_model). ``memory`` must be None (no cross form)."""
        if return_weights:
            raise no_weights_error("Retention", NO_WEIGHTS_HINT)
        if score_mod is not None:
            raise ValueError(
                "Retention cannot apply a score_mod (ALiBi, relative bias): its decay already "
                "encodes distance; use positions='rope', 'learned', 'sinusoidal' or 'none'"
            )
        if memory is not None:
            raise ValueError("Retention has no cross-attention form; memory must be None")
        b, n, _ = x.shape
        q = split_heads(self.q_proj(x), self.n_head)
        k = split_heads(self.k_proj(x), self.n_kv_head)
        v = split_heads(self.v_proj(x), self.n_kv_head)
        start = 0 if cache is None else cache.length
        steps = torch.arange(start, start + n, device=x.device)
        if self.rope is not None:
            positions = steps if positions is None else positions
            q, k = self.rope(q, positions), self.rope(k, positions)
        causal, keep = causal_and_key_mask(mask, b, steps, "Retention")
        if keep is not None:  # a masked key contributes q·0 = 0 everywhere
            k = k * keep[:, None, :, None].to(k.dtype)
        gamma = self.gamma.to(q.dtype)
        if cache is None:
            out = retention(q, k, v, gamma, causal=causal, chunk_size=self.chunk_size)
        elif not causal:
            raise ValueError("cached (incremental) retention needs qkv.causal()")
        else:
            form = "recurrent" if n == 1 else "chunkwise"
            out, cache.state = retention(
                q, k, v, gamma, form=form, chunk_size=self.chunk_size, state=cache.state,
                return_state=True,
            )
            cache.length += n
        normed = self.group_norm(out.transpose(1, 2).reshape(b * n, -1)).view(b, n, -1)
        return self.out_proj(F.silu(self.gate_proj(x)) * normed)


def retention_kind(*, d_model, n_head, n_kv_head, bias, dropout, similarity, weighting, rope,
                   is_cross, depth, forget_gate) -> Retention:
    """The builder of attention kind "retention" (see ``qkv.nn.kinds``)."""
    check_softmax_weighting(weighting, "retention")
    check_no_forget_gate(forget_gate, "retention")
    if similarity != "dot":
        raise ValueError(
            f"attention='retention' uses q·k with a decay; similarity must be 'dot'; got "
            f"{similarity!r}"
        )
    return Retention(d_model, n_head, n_kv_head=n_kv_head, bias=bias, rope=rope,
                     is_cross=is_cross)
