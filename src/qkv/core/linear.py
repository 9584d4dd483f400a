"""Linear attention: softmax(QKᵀ) replaced by a kernel φ(Q)φ(K)ᵀ, so that attention costs
O(N·M·Dv) instead of O(N²·D) (Katharopoulos et al. 2020; Performer, Choromanski et al. 2021).

    out_i = φ(q_i)ᵀ S_i / (φ(q_i)ᵀ z_i + eps),   S_i = Σ_j φ(k_j) v_jᵀ,   z_i = Σ_j φ(k_j)

where j runs over every key (non-causal) or over j <= i (causal). Three causal forms compute
the same numbers:
- quadratic: the (N, N) matrix φ(Q)φ(K)ᵀ, causally masked (the definition; O(N²));
- chunkwise: exact inside chunks of ``chunk_size`` tokens, prefix sums of S and z across them;
- recurrent: one token at a time from a carried ``LinearState`` (generation).

Feature maps (φ applied per token, so every form sees the same features):
- ``"elu"``: elu(x) + 1, M = D;
- ``"favor"``: FAVOR+ positive orthogonal random features, M = projection rows, an unbiased
  estimate of the softmax kernel exp(q·k/√D). Draw the projection with
  ``draw_orthogonal_features``; redrawing it is the module's job.

Half-precision inputs are computed in float32 (features, sums and states); outputs come back
in the input dtype. Linear attention never forms attention weights;
``quadratic_linear_attention`` materializes the normalized φ(Q)φ(K)ᵀ to look at them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import accumulation_dtype, expand_kv_heads

FEATURE_MAPS = ("elu", "favor")


@dataclass
class LinearState:
    """Running sums for causal linear attention: kv (B, H, M, Dv) = Σ φ(k)vᵀ and
    normalizer (B, H, M) = Σ φ(k)."""

    kv: Tensor
    normalizer: Tensor


def check_positive_int(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int; got {value!r}")
    return value


def no_weights_error(kind: str, instead: str) -> ValueError:
    return ValueError(
        f"{kind} has no attention weights: it never forms a softmax over keys, so "
        f"return_weights=True cannot be served. {instead}"
    )


_LINEAR_INSTEAD = (
    "To inspect the token-to-token mixing, call quadratic_linear_attention(q, k, v, ..., "
    "return_weights=True) (from qkv.core.linear), which materializes the normalized "
    "φ(Q)φ(K)ᵀ matrix at O(N²) cost."
)


def draw_orthogonal_features(
    num_features: int,
    head_dim: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device=None,
) -> Tensor:
    """FAVOR+ projection (M, D): blocks of D orthogonal Gaussian directions, each row rescaled
    to the norm of an independent Gaussian vector so that rows are marginally N(0, I)."""
    check_positive_int(num_features, "num_features")
    check_positive_int(head_dim, "head_dim")
    blocks = []
    for _ in range(math.ceil(num_features / head_dim)):
        gaussian = torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64)
        q, r = torch.linalg.qr(gaussian)
        # Fixing the signs of R's diagonal makes Q uniformly distributed (Haar); without it
        # Householder QR favours some directions and the estimate stops converging.
        blocks.append((q * torch.sign(torch.diagonal(r))).T)
    directions = torch.cat(blocks)[:num_features]
    gaussian_rows = torch.randn(num_features, head_dim, generator=generator, dtype=torch.float64)
    norms = gaussian_rows.norm(dim=1)
    return (directions * norms[:, None]).to(dtype=dtype, device=device)


def elu_features(x: Tensor) -> Tensor:
    """(..., D) -> (..., D): elu(x) + 1 > 0."""
    return F.elu(x) + 1


def favor_features(x: Tensor, projection: Tensor, *, is_query: bool) -> Tensor:
    """(..., D) -> (..., M): exp(w·x' - ‖x'‖²/2) / √M with x' = x / D^(1/4), so that
    E[φ(q)·φ(k)] = exp(q·k / √D).

    Queries are shifted by their own max over features: a per-query positive factor that
    cancels between numerator and denominator, and keeps exp from overflowing. Keys are not
    shifted, since a per-key factor would not cancel."""
    x = x * x.shape[-1] ** -0.25
    logits = x @ projection.to(x.dtype).T - (x * x).sum(-1, keepdim=True) / 2
    if is_query:
        logits = logits - logits.amax(-1, keepdim=True).detach()
    return torch.exp(logits) / math.sqrt(projection.shape[0])


def feature_map_of(x: Tensor, kind: str, projection: Tensor | None, *, is_query: bool) -> Tensor:
    """Apply the named feature map to (..., D)."""
    if kind == "elu":
        return elu_features(x)
    if kind == "favor":
        if projection is None:
            raise ValueError(
                "feature_map='favor' needs projection=draw_orthogonal_features(M, D), an (M, D) "
                "tensor of random features"
            )
        if projection.dim() != 2 or projection.shape[1] != x.shape[-1] or projection.shape[0] == 0:
            raise ValueError(
                f"projection must have shape (M, D) with M >= 1 and D={x.shape[-1]}; got "
                f"{tuple(projection.shape)}"
            )
        return favor_features(x, projection, is_query=is_query)
    raise ValueError(f"feature_map must be one of {FEATURE_MAPS}; got {kind!r}")


def _key_features(k, v, heads, kind, projection, key_mask):
    """φ(k) (B, H, Nk, M) and v (B, H, Nk, Dv) for ``heads`` query heads. Keys where
    key_mask (B, Nk) is False get φ(k) = 0: they add nothing to any sum."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, Hkv, Nk, ·)")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k (B, Hkv, Nk, D) and v (B, Hkv, Nk, Dv) must agree on B, Hkv and Nk; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if heads % k.shape[1]:
        raise ValueError(f"H={heads} must be a multiple of Hkv={k.shape[1]}")
    acc = accumulation_dtype(k.dtype)
    phi_k = feature_map_of(k.to(acc), kind, projection, is_query=False)
    phi_k = expand_kv_heads(phi_k, heads)
    if key_mask is not None:
        if key_mask.dtype != torch.bool or key_mask.shape != (k.shape[0], k.shape[2]):
            raise ValueError(
                f"key_mask must be a bool tensor (B, Nk)={(k.shape[0], k.shape[2])}; got "
                f"{key_mask.dtype} {tuple(key_mask.shape)}"
            )
        phi_k = phi_k * key_mask[:, None, :, None].to(phi_k.dtype)
    return phi_k, expand_kv_heads(v.to(acc), heads)


def _features(q, k, v, kind, projection, key_mask=None):
    """Validated inputs -> φ(q) (B, H, N, M), φ(k) (B, H, Nk, M), v (B, H, Nk, Dv)."""
    if not isinstance(q, Tensor) or q.dim() != 4:
        raise ValueError("q must be a 4-D tensor (B, H, N, D)")
    if isinstance(k, Tensor) and k.dim() == 4 and (
        q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]
    ):
        raise ValueError(
            f"q (B, H, Nq, D) and k (B, Hkv, Nk, D) must agree on B and D; got "
            f"{tuple(q.shape)} and {tuple(k.shape)}"
        )
    phi_k, v = _key_features(k, v, q.shape[1], kind, projection, key_mask)
    phi_q = feature_map_of(q.to(accumulation_dtype(q.dtype)), kind, projection, is_query=True)
    return phi_q, phi_k, v


def _check_state(state, phi_q: Tensor, v: Tensor) -> LinearState:
    b, h, _, m = phi_q.shape
    if state is None:
        return LinearState(phi_q.new_zeros(b, h, m, v.shape[-1]), phi_q.new_zeros(b, h, m))
    if not isinstance(state, LinearState):
        raise TypeError(f"state must be a LinearState or None; got {type(state).__name__}")
    if state.kv.shape != (b, h, m, v.shape[-1]) or state.normalizer.shape != (b, h, m):
        raise ValueError(
            f"state does not fit: expected kv {(b, h, m, v.shape[-1])} and normalizer "
            f"{(b, h, m)}; got {tuple(state.kv.shape)} and {tuple(state.normalizer.shape)}"
        )
    return state


def _summary(phi_k: Tensor, v: Tensor) -> LinearState:
    return LinearState(phi_k.transpose(-1, -2) @ v, phi_k.sum(-2))


def _read(phi_q: Tensor, state: LinearState, eps: float) -> Tensor:
    num = phi_q @ state.kv
    den = phi_q @ state.normalizer.unsqueeze(-1)
    return num / (den + eps)


def summarize_keys(
    k: Tensor,
    v: Tensor,
    heads: int,
    *,
    feature_map: str = "elu",
    projection: Tensor | None = None,
    key_mask: Tensor | None = None,
) -> LinearState:
    """Σ φ(k) vᵀ and Σ φ(k) over all keys: k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> a
    LinearState for ``heads`` query heads. What cross-attention keeps of its memory."""
    return _summary(*_key_features(k, v, heads, feature_map, projection, key_mask))


def read_state(
    q: Tensor,
    state: LinearState,
    *,
    feature_map: str = "elu",
    projection: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """Non-causal linear attention of q (B, H, Nq, D) over the keys summarized in ``state``:
    out (B, H, Nq, Dv)."""
    phi_q = feature_map_of(q.to(accumulation_dtype(q.dtype)), feature_map, projection,
                           is_query=True)
    b, h, _, m = phi_q.shape
    if not isinstance(state, LinearState) or state.kv.shape[:3] != (b, h, m):
        raise ValueError("state must be a LinearState for q's batch, heads and feature count")
    return _read(phi_q, state, eps).to(q.dtype)


def quadratic_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: str = "elu",
    projection: Tensor | None = None,
    causal: bool = False,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
):
    """The definition, O(N²): A = φ(Q)φ(K)ᵀ (causally masked, bottom-right aligned), out =
    A v / (A·1 + eps). Returns out (B, H, Nq, Dv), or (out, weights (B, H, Nq, Nk))."""
    phi_q, phi_k, v = _features(q, k, v, feature_map, projection, key_mask)
    scores = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        nq, nk = scores.shape[-2:]
        scores = scores.masked_fill(
            ~torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq), 0.0
        )
    weights = scores / (scores.sum(-1, keepdim=True) + eps)
    out = (weights @ v).to(q.dtype)
    return (out, weights.to(q.dtype)) if return_weights else out


def pad_to_chunks(t: Tensor, chunks: int, chunk_size: int) -> Tensor:
    """(B, H, N, X) -> (B, H, chunks, chunk_size, X), zero-padded at the end (a view when no
    padding is needed)."""
    pad = chunks * chunk_size - t.shape[2]
    return (F.pad(t, (0, 0, 0, pad)) if pad else t).unflatten(2, (chunks, chunk_size))


def _chunked_causal(phi_q, phi_k, v, state: LinearState, chunk_size: int, eps: float):
    """Causal linear attention, N = Nq = Nk, in chunks of C: exact (C, C) products inside a
    chunk, running sums of φ(k)vᵀ and Σφ(k) across chunks. The normalizer rides along as an
    extra value column of ones, so one product yields numerator and denominator."""
    b, h, n, _ = phi_q.shape
    if n == 0:
        return phi_q.new_zeros(b, h, 0, v.shape[-1]), state
    chunks = math.ceil(n / chunk_size)
    v1 = torch.cat([v, v.new_ones(b, h, n, 1)], -1)  # (B, H, N, Dv + 1)
    # Zero features on padded keys add nothing; padded query rows are cut off at the end.
    phi_q, phi_k, v1 = (pad_to_chunks(t, chunks, chunk_size) for t in (phi_q, phi_k, v1))
    carried = torch.cat([state.kv, state.normalizer.unsqueeze(-1)], -1)  # (B, H, M, Dv + 1)
    before = []
    for added in (phi_k.transpose(-1, -2) @ v1).unbind(2):
        before.append(carried)
        carried = carried + added
    intra = (phi_q @ phi_k.transpose(-1, -2)).tril()  # (B, H, C#, C, C)
    both = phi_q @ torch.stack(before, 2) + intra @ v1
    out = both[..., :-1] / (both[..., -1:] + eps)
    return out.flatten(2, 3)[:, :, :n], LinearState(carried[..., :-1], carried[..., -1])


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: str = "elu",
    projection: Tensor | None = None,
    causal: bool = False,
    chunk_size: int = 64,
    state: LinearState | None = None,
    return_state: bool = False,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
    return_weights: bool = False,
):
    """Linear attention, O(N·M·Dv) time.

    Args:
        q: (B, H, N, D); k: (B, Hkv, Nk, D); v: (B, Hkv, Nk, Dv); H a multiple of Hkv.
        feature_map: "elu" or "favor" (then ``projection`` (M, D) is required).
        causal: if True, Nq must equal Nk and query i sees keys j <= i (plus ``state``,
            the sums over every earlier token, for a sequence processed piece by piece).
        chunk_size: tokens per chunk in the causal form (memory O(N/C · M · Dv)).
        return_state: also return the ``LinearState`` after the last token (causal only).
        key_mask: (B, Nk) bool, False for keys no query may see (padding).
        eps: added to the normalizer φ(q)·z.

    Returns:
        out (B, H, N, Dv), or (out, state) when return_state.
    """
    if return_weights:
        raise no_weights_error("linear attention", _LINEAR_INSTEAD)
    check_positive_int(chunk_size, "chunk_size")
    phi_q, phi_k, v = _features(q, k, v, feature_map, projection, key_mask)
    if not causal:
        if state is not None or return_state:
            raise ValueError("state and return_state apply to causal linear attention only")
        return _read(phi_q, _summary(phi_k, v), eps).to(q.dtype)
    if phi_q.shape[2] != phi_k.shape[2]:
        raise ValueError(
            f"causal linear attention needs Nq == Nk (earlier tokens go in state); got "
            f"Nq={phi_q.shape[2]}, Nk={phi_k.shape[2]}"
        )
    state = _check_state(state, phi_q, v)
    out, final = _chunked_causal(phi_q, phi_k, v, state, chunk_size, eps)
    out = out.to(q.dtype)
    return (out, final) if return_state else out


def linear_attention_step(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    state: LinearState | None,
    *,
    feature_map: str = "elu",
    projection: Tensor | None = None,
    key_mask: Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, LinearState]:
    """One generated token in O(M·Dv): q (B, H, 1, D), k (B, Hkv, 1, D), v (B, Hkv, 1, Dv).
    Adds the token to the state, then reads it. Returns out (B, H, 1, Dv) and the new state."""
    if q.dim() != 4 or q.shape[2] != 1 or k.shape[2] != 1:
        raise ValueError(
            f"linear_attention_step takes one token (B, H, 1, D); got q {tuple(q.shape)}"
        )
    phi_q, phi_k, v = _features(q, k, v, feature_map, projection, key_mask)
    state = _check_state(state, phi_q, v)
    added = _summary(phi_k, v)
    state = LinearState(state.kv + added.kv, state.normalizer + added.normalizer)
    return _read(phi_q, state, eps).to(q.dtype), state


def recurrent_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    feature_map: str = "elu",
    projection: Tensor | None = None,
    state: LinearState | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, LinearState]:
    """Causal linear attention token by token (the generation path), O(N·M·Dv) with a Python
    loop: (B, H, N, D) ... -> out (B, H, N, Dv) and the final state."""
    if q.shape[2] == 0:  # split would yield one empty piece, not none
        return q.new_zeros(*q.shape[:3], v.shape[-1]), state
    outs = []
    # split, not indexing: indexing's backward would write a full-size zero tensor per token.
    for q_i, k_i, v_i in zip(*(t.split(1, dim=2) for t in (q, k, v)), strict=True):
        out, state = linear_attention_step(
            q_i, k_i, v_i, state, feature_map=feature_map, projection=projection, eps=eps
        )
        outs.append(out)
    return torch.cat(outs, 2), state
