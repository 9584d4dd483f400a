"""Ring attention: key/value shards travel around the ranks; each rank attends its queries to
every shard as it passes and merges the partial results: by their log-sum-exp (softmax), by
their log-denominator with eps counted once (softpick), by adding them (Carry.NONE: sigmoid,
relu, identity, elementwise). Stick-breaking goes round the same ring in ``stick.py``.

Keys and values travel in pieces of at most KV_ROWS positions, each piece round the ring on
its own: a rank holds one piece in flight (and one arriving), not a whole shard, so its extra
memory is its output and a few pieces, whatever P.

Forward: for each piece, P steps. At step s rank r holds that piece of rank (r - s) mod P's
keys and values; it sends it on to r + 1 while it computes, so the transfer overlaps the work.
Every (query chunk, key piece) pair the mask leaves empty is skipped; a pair it leaves full
runs without the mask.

Backward: the ring again, as in FlashAttention's backward: the pieces go round once more,
together with the dK, dV accumulated for them so far; after P steps each rank holds the
gradient of its own keys and values, piece by piece. A pair's gradient is the engine's own
backward, run with autograd on a recomputed (out_j, lse_j) and weighted by its share of the
output (softmax: w_j = exp(lse_j - lse); Carry.NONE: 1), so any variant the engine
differentiates is differentiated here.
Extra memory per rank: dQ, dK, dV of its shard, one piece with its dK, dV in flight and one
pair's autograd graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from qkv.core.masks import EMPTY, FULL, Mask
from qkv.core.reference import accumulation_dtype
from qkv.core.scores import ScoreMod
from qkv.core.weighting import Weighting

from .layout import chunks
from .partials import partial
from .shift import ShiftedScoreMod, shift_mask

# Query rows per engine call (a multiple of the engines' query blocks, so masks stay aligned).
QUERY_ROWS = 1024
# Key/value rows per piece sent round the ring (a multiple of the engines' key blocks).
KV_ROWS = 1024


@dataclass
class Plan:
    """One context-parallel call: the group, the layout, the global sizes and the variant."""

    group: dist.ProcessGroup | None
    ranks: list[int]  # global ranks of the group, in group order
    rank: int  # this rank's index in the group
    layout: str
    nq_global: int
    nk_global: int
    mask: Mask | None
    score_mod: ScoreMod | None
    engine_kwargs: dict  # similarity, scale, metric, backend
    sum_extra_grads: bool
    weighting: Weighting  # with the whole sequence's Nk bound (for_context)

    @property
    def world(self) -> int:
        return len(self.ranks)


def _pair_kwargs(plan: Plan, q_chunk, kv_chunk, batch: int, heads: int) -> dict | None:
    """The engine's arguments for one (query chunk, key chunk) pair; None when the mask
    leaves it empty."""
    (_, q0, nq), (_, k0, nk) = q_chunk, kv_chunk
    mask = shift_mask(plan.mask, q0, k0, plan.nq_global, plan.nk_global)
    if mask is not None:
        states = mask.tile_states(batch, heads, nq, nk, nq, nk, None)
        if bool((states == EMPTY).all()):
            return None
        if bool((states == FULL).all()):
            mask = None
    score_mod = None
    if plan.score_mod is not None:
        score_mod = ShiftedScoreMod(plan.score_mod, q0, k0, plan.nk_global - plan.nq_global)
    return dict(plan.engine_kwargs, mask=mask, score_mod=score_mod)


def _query_pieces(plan: Plan, nq: int):
    """This rank's query chunks cut into runs of at most QUERY_ROWS: a partial output is
    that big, not the shard's size, and the mask can skip more."""
    for local, start, n in chunks(plan.layout, plan.rank, plan.world, nq):
        for i in range(0, n, QUERY_ROWS):
            yield local + i, start + i, min(QUERY_ROWS, n - i)


def _kv_pieces(plan: Plan, nk: int) -> list[tuple[int, int]]:
    """(local start, length) of the pieces a key/value shard of ``nk`` positions travels in:
    runs of at most KV_ROWS inside one chunk, the same on every rank."""
    return [(local + i, min(KV_ROWS, n - i))
            for local, _, n in chunks(plan.layout, 0, plan.world, nk)
            for i in range(0, n, KV_ROWS)]


class Pair(NamedTuple):
    """One non-empty (query run, key piece) pair: ``rows`` of this rank's queries, ``keys``
    within the piece, the engine's kwargs, ``gap`` = (global end of the run) − (global end of
    the keys), and ``key`` = (local start of the run, global start of the keys), which names
    the pair on every pass of the ring."""

    rows: slice
    keys: slice
    kwargs: dict
    gap: int
    key: tuple[int, int]


def _pairs(plan: Plan, owner: int, q: Tensor, piece: tuple[int, int], nk: int):
    """Every non-empty ``Pair`` of this rank's queries with ``piece`` (local start, length)
    of rank ``owner``'s keys."""
    batch, heads = q.shape[0], q.shape[1]
    start, length = piece
    local, first, _ = next(c for c in chunks(plan.layout, owner, plan.world, nk)
                           if c[0] <= start < c[0] + c[2])
    kc = (0, first + start - local, length)
    for qc in _query_pieces(plan, q.shape[2]):
        kwargs = _pair_kwargs(plan, qc, kc, batch, heads)
        if kwargs is not None:
            yield Pair(slice(qc[0], qc[0] + qc[2]), slice(0, length), kwargs,
                       (qc[1] + qc[2]) - (kc[1] + length), (qc[0], kc[1]))


class _Exchange:
    """Send tensors to the next rank of the ring and receive the previous rank's, async."""

    def __init__(self, plan: Plan, tensors: tuple[Tensor, ...]):
        nxt = plan.ranks[(plan.rank + 1) % plan.world]
        prev = plan.ranks[(plan.rank - 1) % plan.world]
        self.received = tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                              for t in tensors)
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, plan.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, prev, plan.group) for t in self.received]
        self.requests = dist.batch_isend_irecv(ops)

    def wait(self) -> tuple[Tensor, ...]:
        for request in self.requests:
            request.wait()
        return self.received


def ring_pairs(plan: Plan, q: Tensor, k: Tensor, v: Tensor, home=None):
    """(pair, (k, v) of the piece held, the piece's dK, dV or None) for every non-empty pair,
    the pieces going round the ring one after another. With ``home`` (dk, dv), each piece's
    dK, dV (zeros at first; the caller adds to them) travel with it, and after P hops they
    land in ``home``."""
    for piece in _kv_pieces(plan, k.shape[2]):
        start, length = piece
        kv = (k[:, :, start:start + length], v[:, :, start:start + length])
        dkv = None if home is None else tuple(torch.zeros_like(t, dtype=h.dtype)
                                              for t, h in zip(kv, home, strict=True))
        for step in range(plan.world):
            pending = _Exchange(plan, kv) if step < plan.world - 1 else None
            for pair in _pairs(plan, (plan.rank - step) % plan.world, q, piece, k.shape[2]):
                yield pair, kv, dkv
            if dkv is not None and plan.world > 1:
                # dK, dV of the piece held now travel with it; after P hops they are home.
                dkv = _Exchange(plan, dkv).wait()
            if pending is not None:
                kv = pending.wait()
        for total, part in zip(home or (), dkv or (), strict=True):
            total[:, :, start:start + length] = part


def _with_eps(lse: Tensor, eps: float) -> Tensor:
    """log(e^lse + eps): the log of a denominator with the weighting's eps (softmax: 0)."""
    return lse if eps == 0 else torch.logaddexp(lse, torch.full_like(lse, math.log(eps)))


def _merge(out: Tensor, lse: Tensor, o: Tensor, lse_o: Tensor, eps: float = 0.0) -> None:
    """Fold one partial (o, lse_o) into the running (out, lse), in place, in out's dtype:
    lse = logaddexp(lse, lse_o) and, with Z_eps = e^lse + eps, out = Σ o_i Z_eps,i / Z_eps:
    each o_i is its numerator over its own Z_eps,i, so eps counts once. Rows with no key stay
    0, -inf."""
    new = torch.logaddexp(lse, lse_o)
    total = _with_eps(new, eps)
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    out.mul_(torch.exp(_with_eps(lse, eps) - safe).unsqueeze(-1))
    # o is a fresh partial that nothing else reads: scaled in place, no temporary of its size.
    share = torch.exp(_with_eps(lse_o, eps) - safe).unsqueeze(-1)
    out.add_(o.to(out.dtype).mul_(share.to(o.dtype)))
    lse.copy_(new)


def _shares(lse_j: Tensor, lse: Tensor, eps: float = 0.0) -> tuple[Tensor, Tensor]:
    """(Z_eps,j / Z_eps, Z_j / Z_eps): how much of the final output a partial's output holds,
    and d(out)/d(lse_j) = the second times (out_j − out). Softmax: both exp(lse_j − lse)."""
    total = _with_eps(lse, eps)
    safe = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
    w = torch.where(torch.isfinite(lse_j), torch.exp(lse_j - safe), torch.zeros_like(lse))
    return (w if eps == 0 else torch.exp(_with_eps(lse_j, eps) - safe)), w


def _pair_grads(plan: Plan, q: Tensor, k: Tensor, v: Tensor, kwargs: dict, dout: Tensor,
                out: Tensor, lse: Tensor, wanted: list[Tensor]):
    """Gradients of one pair's share of the loss in its q, k, v and the ``wanted`` tensors:
    the engine's backward on the recomputed partial, weighted by its share of the output."""
    acc = out.dtype
    with torch.enable_grad():
        inputs = [t.detach().requires_grad_() for t in (q, k, v)]
        o, lse_o = partial(*inputs, kwargs, plan.weighting)
        if lse_o is None:
            return torch.autograd.grad(o, inputs + wanted, dout.to(o.dtype), allow_unused=True)
        share, w = _shares(lse_o.detach().to(acc), lse, plan.weighting.eps)
        g_lse = w * (dout * (o.detach().to(acc) - out)).sum(-1)
        return torch.autograd.grad((o, lse_o), inputs + wanted,
                                   ((share.unsqueeze(-1) * dout).to(o.dtype),
                                    g_lse.to(lse_o.dtype)), allow_unused=True)


def wanted_extras(ctx) -> list[Tensor]:
    """The extras (inputs from the fifth on) a gradient is asked for."""
    return [t for t, need in zip(ctx.extras, ctx.needs_input_grad[5:], strict=True) if need]


def finish_extras(plan: Plan, ctx, wanted: list[Tensor], d_extras: list[Tensor],
                  more: list[Tensor]) -> list[Tensor | None]:
    """Each extra's gradient (None where none was asked), with ``more`` summed over the
    group alongside when ``plan.sum_extra_grads``."""
    if plan.sum_extra_grads:
        for grad in d_extras + more:
            dist.all_reduce(grad, group=plan.group)
    by_id = dict(zip(map(id, wanted), d_extras, strict=True))
    return [by_id.get(id(t)) for t in ctx.extras]


class RingAttention(torch.autograd.Function):
    """out = ring attention of this rank's q (B, H, nq, D) against every rank's k, v
    (B, Hkv, nk, D|Dv) under a Carry.NONE or Carry.MAX_SUM weighting; ``sinks`` (H,) or None;
    ``extras`` are the tensors the variant reads (ALiBi slopes, a metric, a user similarity's
    weights, a sigmoid bias), listed so gradients reach them."""

    @staticmethod
    def forward(ctx, plan: Plan, q, k, v, sinks, *extras):
        acc = accumulation_dtype(q.dtype)
        b, h, nq, dv = *q.shape[:3], v.shape[3]
        out = torch.zeros(b, h, nq, dv, dtype=acc, device=q.device)
        lse = torch.full((b, h, nq), float("-inf"), dtype=acc, device=q.device)
        for pair, kv, _ in ring_pairs(plan, q, k, v):
            rows, keys = pair.rows, pair.keys
            o, lse_o = partial(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], pair.kwargs,
                               plan.weighting)
            if lse_o is None:
                out[:, :, rows] += o.to(acc)
            else:
                _merge(out[:, :, rows], lse[:, :, rows], o, lse_o, plan.weighting.eps)
        if sinks is not None:
            # The sink is one more partial: lse = s[h], output 0.
            _merge(out, lse, torch.zeros_like(out), sinks.to(acc).view(1, -1, 1).expand_as(lse))
        # The extras themselves, not saved copies: the variant's closures read these objects,
        # and the backward asks autograd for gradients with respect to them.
        ctx.plan, ctx.extras = plan, extras
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        plan = ctx.plan
        q, k, v, sinks, out, lse = ctx.saved_tensors
        acc = out.dtype
        dout = dout.to(acc)
        dq = torch.zeros_like(q, dtype=acc)
        dk, dv = torch.zeros_like(k, dtype=acc), torch.zeros_like(v, dtype=acc)
        wanted = wanted_extras(ctx)
        d_extras = [torch.zeros_like(t) for t in wanted]
        for pair, kv, dkv in ring_pairs(plan, q, k, v, home=(dk, dv)):
            rows, keys = pair.rows, pair.keys
            grads = _pair_grads(plan, q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                pair.kwargs, dout[:, :, rows], out[:, :, rows],
                                lse[:, :, rows], wanted)
            for total, grad in zip([dq[:, :, rows], dkv[0][:, :, keys], dkv[1][:, :, keys]]
                                   + d_extras, grads, strict=True):
                if grad is not None:
                    total.add_(grad.to(total.dtype))
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            # d lse_sink = w_sink · <dout, 0 - out>, summed over batch and rows.
            w = _shares(sinks.to(acc).view(1, -1, 1).expand_as(lse), lse)[1]
            d_sinks = -(w * (dout * out).sum(-1)).sum((0, 2)).to(sinks.dtype)
        d_extras = finish_extras(plan, ctx, wanted, d_extras,
                                 [] if d_sinks is None else [d_sinks])
        return (None, dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sinks, *d_extras)
