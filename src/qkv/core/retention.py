"""Retention (RetNet, Sun et al. 2023): attention without softmax, with an exponential decay
γ per head in place of the normalization.

    out_n = Σ_m γ^(n-m) (q_n · k_m · scale) v_m,   m <= n        (causal)
    out_n = Σ_m γ^|n-m| (q_n · k_m · scale) v_m,   every m       (bidirectional, for encoders)

Three causal forms compute the same numbers:
- parallel:  (QKᵀ·scale ⊙ D) V with the decay matrix D[n, m] = γ^(n-m) (O(N²), the definition);
- recurrent: S_n = γ S_(n-1) + k_n v_nᵀ·scale, out_n = q_n S_n (O(1) per generated token);
- chunkwise: the parallel form inside chunks of C tokens, the recurrent state across them.
A ``state`` S (B, H, D, Dv) carries every earlier token: with it, out_n gains γ^(n+1) q_n S.
Multi-scale retention gives each head its own γ (``retention_decays``); the module around
this core adds the projections, the group norm and the gate. Half-precision inputs are computed
in float32 (γ^n and the state need it); outputs come back in the input dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .linear import check_positive_int, no_weights_error, pad_to_chunks
from .reference import accumulation_dtype, expand_kv_heads

FORMS = ("parallel", "chunkwise", "recurrent")

NO_WEIGHTS_HINT = (
    "What exists instead is the decay matrix D[n, m] = γ^(n-m), decay_matrix(gamma, n), and "
    "the parallel form's retention scores QKᵀ·scale ⊙ D, retention_scores(q, k, gamma) (both "
    "from qkv.core.retention)."
)


def retention_decays(num_heads: int, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
    """RetNet's multi-scale decays (H,): γ_h = 1 - 2^(-5-h), from 0.969 up toward 1."""
    check_positive_int(num_heads, "num_heads")
    exponent = -5.0 - torch.arange(num_heads, dtype=torch.float64)
    return (1 - 2**exponent).to(dtype=dtype, device=device)


def _check_gamma(gamma, heads: int) -> Tensor:
    if not isinstance(gamma, Tensor) or gamma.shape != (heads,):
        shape = tuple(gamma.shape) if isinstance(gamma, Tensor) else type(gamma).__name__
        raise ValueError(f"gamma must be a tensor of shape (H,)=({heads},); got {shape}")
    if not ((gamma > 0) & (gamma <= 1)).all():
        raise ValueError("gamma must lie in (0, 1] (a decay per head)")
    return gamma


def decay_matrix(gamma: Tensor, nq: int, nk: int | None = None, *, causal: bool = True) -> Tensor:
    """D (H, Nq, Nk): γ^(p-m) for key m at or before query position p = n + Nk - Nq (0 after
    it when causal; γ^|p-m| when not)."""
    nk = nq if nk is None else nk
    pos = torch.arange(nq, device=gamma.device).view(-1, 1) + (nk - nq)
    distance = pos - torch.arange(nk, device=gamma.device).view(1, -1)
    exponent = distance.abs().to(gamma.dtype) * torch.log(gamma).view(-1, 1, 1)
    if causal:
        exponent = exponent.masked_fill(distance < 0, float("-inf"))
    return torch.exp(exponent)


def _prepare(q, k, v, gamma, scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, N, D)")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"expected q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv); got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    heads = q.shape[1]
    if heads % k.shape[1]:
        raise ValueError(f"H={heads} must be a multiple of Hkv={k.shape[1]}")
    gamma = _check_gamma(gamma, heads).to(q.dtype)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = expand_kv_heads(k, heads) * scale
    return k, expand_kv_heads(v, heads), gamma


def _check_state(state, q: Tensor, v: Tensor) -> Tensor:
    b, h, _, d = q.shape
    expected = (b, h, d, v.shape[-1])
    if state is None:
        return q.new_zeros(expected)
    if not isinstance(state, Tensor) or state.shape != expected:
        got = tuple(state.shape) if isinstance(state, Tensor) else type(state).__name__
        raise ValueError(f"state must be a tensor (B, H, D, Dv)={expected}; got {got}")
    return state


def retention_scores(q: Tensor, k: Tensor, gamma: Tensor, *, scale=None, causal=True) -> Tensor:
    """QKᵀ·scale ⊙ D (B, H, Nq, Nk): what the parallel form multiplies V by."""
    k, _, gamma = _prepare(q, k, k, gamma, scale)
    return (q @ k.transpose(-1, -2)) * decay_matrix(gamma, q.shape[2], k.shape[2], causal=causal)


def _powers(gamma: Tensor, exponents: Tensor) -> Tensor:
    """γ_h^e for every head and exponent: (H, len(e))."""
    return torch.exp(exponents.to(gamma.dtype).view(1, -1) * torch.log(gamma).view(-1, 1))


def _parallel(q, k, v, gamma, state, causal):
    n = q.shape[2]
    out = ((q @ k.transpose(-1, -2)) * decay_matrix(gamma, n, causal=causal)) @ v
    from_state = _powers(gamma, torch.arange(1, n + 1, device=q.device))  # γ^(n+1): (H, N)
    out = out + from_state[None, :, :, None] * (q @ state)
    to_end = _powers(gamma, torch.arange(n - 1, -1, -1, device=q.device))  # γ^(N-1-m)
    final = _powers(gamma, torch.tensor([n], device=q.device)).view(1, -1, 1, 1) * state
    final = final + (k * to_end[None, :, :, None]).transpose(-1, -2) @ v
    return out, final


def _chunkwise(q, k, v, gamma, state, chunk_size):
    b, h, n, d = q.shape
    c = chunk_size
    chunks = -(-n // c)
    q, k, v = (pad_to_chunks(t, chunks, c) for t in (q, k, v))  # (B, H, C#, C, ·)
    inner = ((q @ k.transpose(-1, -2)) * decay_matrix(gamma, c)[:, None]) @ v
    # Within chunk i, token s reaches the end of the chunk's real tokens with decay
    # γ^(end_i - 1 - s); a chunk of L real tokens decays the incoming state by γ^L.
    positions = torch.arange(chunks * c, device=q.device).view(chunks, c)
    ends = torch.clamp((torch.arange(chunks, device=q.device) + 1) * c, max=n).view(-1, 1)
    to_end = _powers(gamma, (ends - 1 - positions).clamp(min=0).flatten()).view(h, chunks, c)
    contributions = (k * to_end[None, :, :, :, None]).transpose(-1, -2) @ v  # (B, H, C#, D, Dv)
    lengths = (ends.flatten() - torch.arange(chunks, device=q.device) * c)
    chunk_decay = _powers(gamma, lengths)  # (H, C#)
    before = []
    # unbind, not indexing: indexing's backward would write a full-size zero tensor per chunk.
    for decay, added in zip(chunk_decay.unbind(1), contributions.unbind(2), strict=True):
        before.append(state)
        state = decay.view(1, -1, 1, 1) * state + added
    cross = _powers(gamma, torch.arange(1, c + 1, device=q.device))[None, :, None, :, None]
    out = inner + cross * (q @ torch.stack(before, 2)) if chunks else inner
    return out.flatten(2, 3)[:, :, :n], state


def retention_step(q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, state: Tensor | None, *,
                   scale=None) -> tuple[Tensor, Tensor]:
    """One token in O(D·Dv): q (B, H, 1, D), k (B, Hkv, 1, D), v (B, Hkv, 1, Dv).
    Returns out (B, H, 1, Dv) and the new state (B, H, D, Dv)."""
    if q.dim() != 4 or q.shape[2] != 1 or k.dim() != 4 or k.shape[2] != 1:
        raise ValueError(f"retention_step takes one token (B, H, 1, D); got q {tuple(q.shape)}")
    dtype = q.dtype
    q, k, v = (t.to(accumulation_dtype(dtype)) for t in (q, k, v))
    k, v, gamma = _prepare(q, k, v, gamma, scale)
    state = _check_state(state, q, v)
    state = gamma.view(1, -1, 1, 1) * state + k.transpose(-1, -2) @ v
    return (q @ state).to(dtype), state


def _recurrent(q, k, v, gamma, state, scale):
    if q.shape[2] == 0:  # split would yield one empty piece, not none
        return q.new_zeros(*q.shape[:3], v.shape[-1]), state
    outs = []
    for q_i, k_i, v_i in zip(*(t.split(1, dim=2) for t in (q, k, v)), strict=True):
        out, state = retention_step(q_i, k_i, v_i, gamma, state, scale=scale)
        outs.append(out)
    return torch.cat(outs, 2), state


def retention(
    q: Tensor, k: Tensor, v: Tensor, gamma: Tensor, *, form: str = "chunkwise",
    causal: bool = True, chunk_size: int = 64, scale=None, state: Tensor | None = None,
    return_state: bool = False, return_weights: bool = False,
):
    """Multi-scale retention.

    Args:
        q: (B, H, N, D); k: (B, Hkv, N, D); v: (B, Hkv, N, Dv); H a multiple of Hkv.
        gamma: (H,) decays in (0, 1], e.g. ``retention_decays(H)``.
        form: "parallel" (O(N²)), "chunkwise" (O(N·C)) or "recurrent" (token loop).
        causal: False gives bidirectional retention γ^|n-m| (no state).
        chunk_size: tokens per chunk for the chunkwise form.
        scale: multiplies q·k; default 1/√D.
        state: (B, H, D, Dv) from an earlier call, carrying every earlier token (causal).
        return_state: also return the state after the last token.

    Returns:
        out (B, H, N, Dv), or (out, state).
    """
    if return_weights:
        raise no_weights_error("retention", NO_WEIGHTS_HINT)
    check_positive_int(chunk_size, "chunk_size")
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}; got {form!r}")
    if q.dim() == 4 and k.dim() == 4 and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"retention needs Nq == Nk (earlier tokens go in state); got Nq={q.shape[2]}, "
            f"Nk={k.shape[2]}"
        )
    acc = accumulation_dtype(q.dtype)
    if q.dtype != acc:
        result = retention(
            q.to(acc), k.to(acc), v.to(acc), gamma, form=form, causal=causal,
            chunk_size=chunk_size, scale=scale, state=state, return_state=return_state,
        )
        return (result[0].to(q.dtype), result[1]) if return_state else result.to(q.dtype)
    k_scaled, v_heads, gamma = _prepare(q, k, v, gamma, scale)
    if not causal:
        if state is not None or return_state:
            raise ValueError("state and return_state apply to causal retention only")
        if form == "parallel":
            zero = _check_state(None, q, v_heads)
            return _parallel(q, k_scaled, v_heads, gamma, zero, causal=False)[0]
        # Bidirectional = forward pass + backward pass - the diagonal counted twice.
        forward = retention(q, k, v, gamma, form=form, chunk_size=chunk_size, scale=scale)
        backward = retention(q.flip(2), k.flip(2), v.flip(2), gamma, form=form,
                             chunk_size=chunk_size, scale=scale).flip(2)
        return forward + backward - (q * k_scaled).sum(-1, keepdim=True) * v_heads
    state = _check_state(state, q, v_heads)
    if form == "parallel":
        out, state = _parallel(q, k_scaled, v_heads, gamma, state, causal=True)
    elif form == "chunkwise":
        out, state = _chunkwise(q, k_scaled, v_heads, gamma, state, chunk_size)
    else:
        out, state = _recurrent(q, k, v, gamma, state, scale)
    return (out, state) if return_state else out
