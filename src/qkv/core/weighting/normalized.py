"""``Carry.MAX_SUM``: weightings normalized over the row (softmax, softpick), carried as a
running max and sum."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import Carry, Weighting, zero_masked


class Normalized(Weighting):
    """w = e^s a(s) / (Σ_{j∈M} e^s b(s) + eps), carried as a running max (never below
    ``max_floor``) and sum."""

    carry = Carry.MAX_SUM
    max_floor = float("-inf")
    eps = 0.0

    def terms(self, s: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
        """(e^(s−m) a(s), e^(s−m) b(s)): the numerator and denominator terms of scores s
        relative to a max m >= s (broadcastable)."""
        raise NotImplementedError

    def slopes(self, s: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """(a', b'): (e^s a)' / e^s and (e^s b)' / e^s at s, for the gradient."""
        raise NotImplementedError

    def weights(self, s, allowed, pos_q, kv_idx, heads=None):
        safe = zero_masked(s, allowed)
        low = torch.full((), float("-inf"), dtype=s.dtype, device=s.device)
        m = torch.where(allowed, safe, low).amax(-1, keepdim=True)
        m = m.clamp_min(self.max_floor) if self.max_floor > float("-inf") else m
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
        num, den = self.terms(safe, m)
        num, den = zero_masked(num, allowed), zero_masked(den, allowed)
        z = den.sum(-1, keepdim=True) + self.eps * torch.exp(-m)
        return num / torch.where(z == 0, torch.ones_like(z), z)


class Softmax(Normalized):
    """exp(s) / Σ exp(s), as in "Attention Is All You Need"."""

    name = "softmax"
    is_softmax = True

    def terms(self, s, m):
        e = torch.exp(s - m)
        return e, e

    def slopes(self, s):
        return 1.0, 1.0


class Softpick(Normalized):
    """relu(e^s − 1) / (Σ_{j∈M} |e^s − 1| + eps) (Zuhri et al., "Softpick: No Attention Sink,
    No Massive Activations with Rectified Softmax", 2025): weights may be exactly 0 and rows
    may sum to less than 1, so no key has to absorb the rest. The max never drops below 0, so
    e^(−m) stays at most 1 for rows of very negative scores."""

    name = "softpick"
    max_floor = 0.0

    def __init__(self, eps: float = 1e-6):
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"softpick: eps must be a positive number; got {eps!r}")
        self.eps = float(eps)

    def terms(self, s, m):
        # e^(s-m) - e^(-m) = e^(-m) (e^s - 1): expm1 keeps the digits near s = 0.
        d = torch.where(s < 1, torch.expm1(s.clamp_max(1)) * torch.exp(-m),
                        torch.exp(s - m) - torch.exp(-m))
        return torch.relu(d), d.abs()

    def slopes(self, s):
        return (s > 0).to(s.dtype), torch.sign(s)

    def __repr__(self):
        return f"softpick(eps={self.eps:g})"
