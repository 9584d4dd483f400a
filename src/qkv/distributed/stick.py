"""Stick-breaking across the ring: a key piece's weights are its own stick-breaking times the
stick that the nearer keys left.

For one query run, with the pairs J it meets (key pieces of any rank), the engine's
stick-breaking output out_J of the pair and σ_J, the sum of its weights (a value column of
ones), the pair's keys leave the stick s_J = 1 − σ_J of what reached them, and

    out = Σ_J R_J out_J,  R_J = ∏ s_J' over the pairs J' nearer the query (later keys).

The pieces arrive in ring order, not key order, so the forward goes round twice: first the
sticks (one value column), then the outputs, R_J known. It keeps one (B, H, run) stick per
non-empty pair. The backward: d out_J = R_J·dout, and d σ_m = −R_m·A_m with
A_m = Σ_{k farther} d_k ∏_{m<i<k} s_i and d_k = ⟨dout, out_k⟩, a scan from the farthest pair
that never divides by a stick (which may be 0). One ring pass computes the d_k, a second the
engine's backward of (out_J, σ_J) with those weights, with dK, dV travelling home.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.core.reference import accumulation_dtype

from .partials import stick_partial
from .ring import Pair, Plan, finish_extras, ring_pairs, wanted_extras


def _call(plan: Plan, q: Tensor, k: Tensor, v: Tensor, pair: Pair) -> Tensor:
    """The engine's stick-breaking of this rank's queries ``q`` against the pair's keys."""
    return stick_partial(q[:, :, pair.rows], k[:, :, pair.keys], v, pair.kwargs, pair.gap,
                         plan.weighting)


def _ones(v: Tensor) -> Tensor:
    return v.new_ones(*v.shape[:3], 1)


def _nearest_first(table: dict) -> list[list[tuple[int, int]]]:
    """The keys of ``table`` grouped by query run, each group nearest keys first."""
    runs: dict[int, list] = {}
    for key in sorted(table, key=lambda key: -key[1]):
        runs.setdefault(key[0], []).append(key)
    return list(runs.values())


def _carried(sticks: dict) -> dict:
    """pair -> R, the product of the sticks of the pairs nearer its query run."""
    before = {}
    for keys in _nearest_first(sticks):
        left = torch.ones_like(sticks[keys[0]])
        for key in keys:
            before[key] = left
            left = left * sticks[key]
    return before


def _pulls(sticks: dict, before: dict, dots: dict) -> dict:
    """pair -> d(loss)/dσ = −R·A, A accumulated from the farthest pair inwards."""
    pulls = {}
    for keys in _nearest_first(sticks):
        behind = torch.zeros_like(sticks[keys[0]])
        for key in reversed(keys):
            pulls[key] = -before[key] * behind
            behind = dots[key] + sticks[key] * behind
    return pulls


class StickRing(torch.autograd.Function):
    """out = ring attention of this rank's q under stick-breaking; the arguments are
    ``RingAttention``'s (``sinks`` always None: stick-breaking has no denominator)."""

    @staticmethod
    def forward(ctx, plan: Plan, q, k, v, sinks, *extras):
        acc = accumulation_dtype(q.dtype)
        sticks = {}
        for pair, (k_j, v_j), _ in ring_pairs(plan, q, k, v):
            sigma = _call(plan, q, k_j, _ones(v_j[:, :, pair.keys]), pair)[..., 0]
            sticks[pair.key] = 1 - sigma.to(acc)
        before = _carried(sticks)
        out = torch.zeros(*q.shape[:3], v.shape[3], dtype=acc, device=q.device)
        for pair, (k_j, v_j), _ in ring_pairs(plan, q, k, v):
            o = _call(plan, q, k_j, v_j[:, :, pair.keys], pair)
            out[:, :, pair.rows] += before[pair.key].unsqueeze(-1) * o.to(acc)
        ctx.plan, ctx.extras, ctx.sticks = plan, extras, sticks
        ctx.save_for_backward(q, k, v)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        plan, sticks = ctx.plan, ctx.sticks
        q, k, v = ctx.saved_tensors
        acc = accumulation_dtype(q.dtype)
        dout = dout.to(acc)
        dots = {}
        for pair, (k_j, v_j), _ in ring_pairs(plan, q, k, v):
            o = _call(plan, q, k_j, v_j[:, :, pair.keys], pair)
            dots[pair.key] = (dout[:, :, pair.rows] * o.to(acc)).sum(-1)
        before = _carried(sticks)
        pulls = _pulls(sticks, before, dots)
        dq = torch.zeros_like(q, dtype=acc)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        wanted = wanted_extras(ctx)
        d_extras = [torch.zeros_like(t) for t in wanted]
        for pair, (k_j, v_j), dkv in ring_pairs(plan, q, k, v, home=(dk, dv)):
            rows, keys = pair.rows, pair.keys
            with torch.enable_grad():
                inputs = [t.detach().requires_grad_()
                          for t in (q[:, :, rows], k_j[:, :, keys], v_j[:, :, keys])]
                o = stick_partial(*inputs[:2], torch.cat([inputs[2], _ones(inputs[2])], -1),
                                  pair.kwargs, pair.gap, plan.weighting)
                cotangent = torch.cat([before[pair.key].unsqueeze(-1) * dout[:, :, rows],
                                       pulls[pair.key].unsqueeze(-1)], -1)
                grads = torch.autograd.grad(o, inputs + wanted, cotangent.to(o.dtype),
                                            allow_unused=True)
            for total, grad in zip([dq[:, :, rows], dkv[0][:, :, keys], dkv[1][:, :, keys]]
                                   + d_extras, grads, strict=True):
                if grad is not None:
                    total.add_(grad.to(total.dtype))
        d_extras = finish_extras(plan, ctx, wanted, d_extras, [])
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, *d_extras)
