"""``LinearAttention``: multi-head linear attention as a block's attention kind.

The kinds ``attention="linear"`` (elu+1 features) and ``attention="linear_favor"`` (FAVOR+
random features) of every model config; see ``qkv.nn.kinds`` for the protocol.
Generation keeps a ``StateCache``: the running sums Σφ(k)vᵀ and Σφ(k), O(1) in length.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..core.linear import (
    LinearState,
    check_positive_int,
    draw_orthogonal_features,
    linear_attention,
    no_weights_error,
    read_state,
    summarize_keys,
)
from ..core.masks import (
    AndMask,
    CausalMask,
    NotMask,
    OrMask,
    PaddingMask,
    TensorMask,
    as_mask,
)
from ..core.weighting import as_weighting
from .forget_gate import check_no_forget_gate
from .heads import merge_heads, split_heads
from .linear import Linear
from .positions import RotaryEmbedding


class StateCache:
    """The generation state of one recurrent attention layer: ``state`` (a LinearState or a
    retention state tensor, None before the first call) and the positions absorbed so far."""

    def __init__(self):
        self.state: LinearState | Tensor | None = None
        self.length = 0

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (B',) in that order (beam search)."""
        if isinstance(self.state, LinearState):
            self.state = LinearState(
                self.state.kv.index_select(0, index), self.state.normalizer.index_select(0, index)
            )
        elif self.state is not None:
            self.state = self.state.index_select(0, index)


def _conjuncts(mask) -> list:
    if type(mask) is AndMask:
        return _conjuncts(mask.a) + _conjuncts(mask.b)
    return [mask]


def _keys_only(mask) -> bool:
    """Whether the mask depends on the key position and batch row only (padding)."""
    if isinstance(mask, PaddingMask):
        return True
    if isinstance(mask, NotMask):
        return _keys_only(mask.inner)
    if isinstance(mask, TensorMask):
        return mask.allowed.shape[1] == 1 and mask.allowed.shape[2] == 1
    if type(mask) in (AndMask, OrMask):
        return _keys_only(mask.a) and _keys_only(mask.b)
    return False


def causal_and_key_mask(mask, batch: int, key_positions: Tensor, kind: str):
    """Split a block's mask into (causal: bool, key_mask (B, Nk) bool or None).

    Kinds without a score matrix can honour ``qkv.causal()`` and masks over keys alone
    (``qkv.padding``, ``~qkv.padding``, bool (B, 1, 1, Nk)), combined with &; key_positions
    (Nk,) are the absolute positions of this call's keys."""
    mask = as_mask(mask)
    if mask is None:
        return False, None
    parts = _conjuncts(mask)
    causal = any(isinstance(p, CausalMask) for p in parts)
    key_parts = [p for p in parts if not isinstance(p, CausalMask)]
    if not all(_keys_only(p) for p in key_parts):
        raise ValueError(
            f"{kind} supports only qkv.causal() and key padding masks (qkv.padding, "
            f"~qkv.padding, bool (B, 1, 1, Nk)), combined with &; got {mask!r}"
        )
    if not key_parts:
        return causal, None
    n = key_positions.numel()
    b = torch.arange(batch, device=key_positions.device).view(-1, 1, 1, 1)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=key_positions.device)
    keep = torch.ones(batch, n, dtype=torch.bool, device=key_positions.device)
    for part in key_parts:
        allowed = part.mask_mod(b, zero, zero, key_positions.view(1, 1, 1, -1), 0)
        keep = keep & torch.as_tensor(allowed).expand(batch, 1, 1, n).reshape(batch, n)
    return causal, keep


def performer_feature_count(head_dim: int) -> int:
    """Performer's default M = D·ln D random features (at least D)."""
    return max(head_dim, int(head_dim * math.log(head_dim)))


class LinearAttention(nn.Module):
    """Multi-head linear attention: W^Q, W^K, W^V and W^O around ``linear_attention``.

    Args:
        d_model: width of the input and output; head_dim = d_model / n_head.
        n_head, n_kv_head: query heads H and key/value heads Hkv (H % Hkv == 0).
        bias: bias in the projections.
        feature_map: "elu" (elu+1) or "favor" (FAVOR+ positive orthogonal random features).
        num_features: FAVOR+ features M (default D·ln D).
        redraw_interval: FAVOR+ draws a fresh projection every this many training-mode
            calls (None: never). The projection is a buffer, saved with the model.
        chunk_size: chunk length of the causal form.
        rope: a shared RotaryEmbedding applied to q and k before the feature map.
        is_cross: attention over an encoder memory (kept as Σφ(k)vᵀ after the first call).

    Masks: ``qkv.causal()`` selects the causal form; key padding masks are honoured. There
    are no attention weights (so no dropout on them, and ``return_weights`` is refused).
    """

    def __init__(
        self, d_model: int, n_head: int, *, n_kv_head: int | None = None, bias: bool = True,
        feature_map: str = "elu", num_features: int | None = None,
        redraw_interval: int | None = 1000, chunk_size: int = 64, eps: float = 1e-6,
        rope: RotaryEmbedding | None = None, is_cross: bool = False,
    ):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_head <= 0 or n_kv_head <= 0 or d_model % n_head or n_head % n_kv_head:
            raise ValueError(
                f"need d_model % n_head == 0 and n_head % n_kv_head == 0 (all positive); got "
                f"d_model={d_model}, n_head={n_head}, n_kv_head={n_kv_head}"
            )
        if feature_map not in ("elu", "favor"):
            raise ValueError(f"feature_map must be 'elu' or 'favor'; got {feature_map!r}")
        if redraw_interval is not None and (not isinstance(redraw_interval, int)
                                            or redraw_interval <= 0):
            raise ValueError(f"redraw_interval must be None or a positive int; got "
                             f"{redraw_interval!r}")
        if rope is not None and is_cross:
            raise ValueError("rope applies to self-attention only, not to is_cross=True")
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d_model // n_head
        self.feature_map, self.eps = feature_map, eps
        self.chunk_size = check_positive_int(chunk_size, "chunk_size")
        self.redraw_interval, self.calls_since_redraw = redraw_interval, 0
        self.rope, self.is_cross = rope, is_cross
        self.q_proj = Linear(d_model, d_model, bias=bias)
        self.k_proj = Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.v_proj = Linear(d_model, n_kv_head * self.head_dim, bias=bias)
        self.out_proj = Linear(d_model, d_model, bias=bias)
        projection = None
        if feature_map == "favor":
            m = performer_feature_count(self.head_dim) if num_features is None else num_features
            projection = draw_orthogonal_features(m, self.head_dim)
        self.register_buffer("projection", projection)

    def redraw_features(self) -> None:
        """Draw a fresh FAVOR+ projection (from torch's global generator)."""
        if self.projection is not None:
            self.projection = draw_orthogonal_features(
                self.projection.shape[0], self.head_dim, dtype=self.projection.dtype,
                device=self.projection.device,
            )
        self.calls_since_redraw = 0

    def new_cache(self, batch: int, max_len: int, *, device=None, dtype=None) -> StateCache:
        """An empty state; its size does not grow with the sequence, so max_len is not used."""
        return StateCache()

    def _kwargs(self) -> dict:
        return {"feature_map": self.feature_map, "projection": self.projection}

    def forward(
        self, x: Tensor, memory: Tensor | None = None, *, mask=None, score_mod=None,
        positions: Tensor | None = None, cache: StateCache | None = None,
        return_weights: bool = False,
    ) -> Tensor:
        """x (B, N, d_model), memory (B, M, d_model) for cross-attention -> (B, N, d_model)."""
        if return_weights:
            raise no_weights_error(
                "LinearAttention", "Use attention='multihead' layers to capture weights."
            )
        if score_mod is not None:
            raise ValueError(
                "LinearAttention cannot apply a score_mod (ALiBi, relative bias): it never forms "
                "scores; use positions='rope', 'learned' or 'sinusoidal'"
            )
        if self.training and self.redraw_interval is not None and self.projection is not None:
            self.calls_since_redraw += 1
            if self.calls_since_redraw >= self.redraw_interval:
                self.redraw_features()
        q = split_heads(self.q_proj(x), self.n_head)
        if self.is_cross:
            out = self._cross(q, memory, mask, cache)
        else:
            out = self._self(x, q, mask, positions, cache)
        return self.out_proj(merge_heads(out))

    def _cross(self, q, memory, mask, cache):
        if cache is not None and cache.state is not None:
            state = cache.state
        else:
            if memory is None:
                raise ValueError("cross-attention needs memory on its first call")
            k = split_heads(self.k_proj(memory), self.n_kv_head)
            v = split_heads(self.v_proj(memory), self.n_kv_head)
            positions = torch.arange(memory.shape[1], device=memory.device)
            causal, keep = causal_and_key_mask(mask, memory.shape[0], positions, "LinearAttention")
            if causal:
                raise ValueError("cross-attention takes no causal mask")
            state = summarize_keys(k, v, self.n_head, key_mask=keep, **self._kwargs())
            if cache is not None:
                cache.state = state
        return read_state(q, state, eps=self.eps, **self._kwargs())

    def _self(self, x, q, mask, positions, cache):
        k = split_heads(self.k_proj(x), self.n_kv_head)
        v = split_heads(self.v_proj(x), self.n_kv_head)
        start = 0 if cache is None else cache.length
        steps = torch.arange(start, start + x.shape[1], device=x.device)
        if self.rope is not None:
            positions = steps if positions is None else positions
            q, k = self.rope(q, positions), self.rope(k, positions)
        causal, keep = causal_and_key_mask(mask, x.shape[0], steps, "LinearAttention")
        kwargs = {"key_mask": keep, "chunk_size": self.chunk_size, "eps": self.eps,
                  **self._kwargs()}
        if cache is None:
            return linear_attention(q, k, v, causal=causal, **kwargs)
        if not causal:
            raise ValueError("cached (incremental) linear self-attention needs qkv.causal()")
        out, cache.state = linear_attention(
            q, k, v, causal=True, state=cache.state, return_state=True, **kwargs
        )
        cache.length += x.shape[1]
        return out


def _check_dot(similarity: str, kind: str) -> None:
    if similarity != "dot":
        raise ValueError(
            f"attention={kind!r} replaces the similarity with its own kernel; similarity must "
            f"be 'dot'; got {similarity!r}"
        )


def check_softmax_weighting(weighting, kind: str) -> None:
    """A kind with its own way from scores to outputs refuses any other weighting."""
    if not as_weighting(weighting).is_softmax:
        raise ValueError(f"attention={kind!r} has its own normalization, not a weighting of "
                         f"scores; weighting must be 'softmax'; got {weighting!r}")


def linear_kind(feature_map: str, kind: str):
    """The builder of attention kind ``kind`` (see ``qkv.nn.kinds``)."""
    def build(*, d_model, n_head, n_kv_head, bias, dropout, similarity, weighting, rope,
              is_cross, depth, forget_gate) -> LinearAttention:
        _check_dot(similarity, kind)
        check_softmax_weighting(weighting, kind)
        check_no_forget_gate(forget_gate, kind)
        return LinearAttention(
            d_model, n_head, n_kv_head=n_kv_head, bias=bias, feature_map=feature_map, rope=rope,
            is_cross=is_cross,
        )

    return build
