"""The fused CPU engine: blockwise online-softmax attention, forward and backward, for every
similarity, mask, score modifier and weighting (the other weightings' rows carry their own
statistic: ``carries``, and the C blocks' branches).

- Forward: for each query block, visit the key blocks the mask does not rule out
  (``tile_plan``), keep a running max, sum and output (FlashAttention's online softmax), and
  save only the output and the log-sum-exp. No (Nq, Nk) tensor is held: extra memory is
  O((Nq + Nk)·D) plus one tile of scores.
- Backward: recompute each tile's scores from the same definitions and the saved
  log-sum-exp. The pairwise term's gradients are the fast forms registered with it (matmuls
  for dot and L2, C loops for L1), or C loops generated from a user's term (``kernelgen.c``,
  which also return the gradients of the tensors the term reads); a term with neither is
  differentiated by autograd through its definition. The elementwise part (scale, modifier,
  mask) runs under a small autograd graph per tile when it has anything to differentiate,
  so gradients reach the score modifier's tensors
  (ALiBi slopes, bias tables, tensors captured by user callables) and a tensor scale.
- Similarity features (unit-normalize, the Mahalanobis map) are O(N·D) and run outside the
  tile loop under ordinary autograd, so gradients reach q, k and the metric.
- Sparse graph masks are the graph engine's (``graph_gather``), ahead of this one in the
  dispatch order.
- Dropout runs in the engine: each tile's keep mask comes from its own seeded generator, so
  the backward pass regenerates it exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...core.problem import Problem
from ...core.result import Result
from .. import ops
from ..kernelgen import c as c_target
from ..kernelgen import c_mod
from ..lowering import Lowered, lower
from . import carries, native, native_blocks, paths
from .fused_backward import backward, exp_, probabilities
from .paths import CpuPath
from .tiles import (
    TileSpec,
    cpu_why_not,
    draw_seed,
    dropout_keep,
    extra_tensors,
    group_heads,
    keys_visited,
    score_features,
    scratch_for,
    tile_index,
    tile_mask,
    tile_plan,
    tile_scores,
    tile_spec,
)
from .workers import run_queued


def _needs_grad(p: Problem) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in (p.q, p.k, p.v, *p.grad_tensors())
    )


def why_not(p: Problem) -> str | None:
    reason = cpu_why_not(p)
    if reason is not None:
        return reason
    if p.return_weights and _needs_grad(p):
        return (
            "return_weights=True while gradients are needed: the fused engine returns weights "
            "recomputed from its log-sum-exp without a gradient; use backend='reference'"
        )
    return None


def _softmax_step(s: Tensor, row_max: Tensor, row_sum: Tensor, acc: Tensor,
                  allowed: Tensor | None) -> Tensor:
    """One online-softmax update for a tile's scores s (B, H, bq, bk): returns
    p = exp(s - max) (s's memory, reused), 0 where the bool mask ``allowed`` forbids;
    row_max and row_sum (B, H, bq, 1) are updated and the output accumulator acc
    (B, H, bq, Dv) rescaled by exp(old max - new max), in place. A row with nothing allowed
    so far keeps max -inf and subtracts 0, so exp gives 0, not NaN."""
    s = s.contiguous()
    if native.available(s.dtype):
        native.online_softmax_step(s, row_max, row_sum, acc, allowed)
        return s
    if allowed is not None:
        s = s.masked_fill_(~allowed, float("-inf"))
    new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
    safe = new_max.masked_fill(new_max == float("-inf"), 0.0)
    p = exp_(s.sub_(safe))
    correction = (row_max - safe).exp_()
    row_sum.mul_(correction).add_(p.sum(-1, keepdim=True))
    acc.mul_(correction)
    row_max.copy_(new_max)
    return p


def _forward_block(spec: TileSpec, i: int, tiles, fq, fk, v, out, lse, scratch) -> None:
    """Online softmax over the key tiles of query block i; writes its rows of out and lse.
    Scores go to the worker's ``scratch`` buffer: one allocation per worker, not per tile
    (freeing and re-faulting a megabyte per tile costs two threads a quarter of their time)."""
    batch, heads, dv = spec.batch, spec.heads, v.shape[-1]
    hk, hv = fk.shape[1], v.shape[1]
    q0, q1 = spec.q_range(i)
    fq_t = group_heads(fq[:, :, q0:q1], hk)
    row_max = fq.new_full((batch, heads, q1 - q0, 1), float("-inf"))
    row_sum = torch.zeros_like(row_max)
    acc = fq.new_zeros(batch, heads, q1 - q0, dv)
    # (B·Hv, (H/Hv)·bq, Dv): grouped heads share their v head in one batched matmul.
    acc_grouped = acc.view(batch * hv, -1, dv)
    for k0, k1, masked in tiles:
        idx = tile_index(spec, q0, q1, k0, k1, fq.device)
        # The mask is applied by the softmax step, not written into the scores first.
        s = tile_scores(spec, fq_t, fk[:, :, k0:k1], idx, False, scratch)
        p = _softmax_step(s, row_max, row_sum, acc, tile_mask(spec, idx) if masked else None)
        if spec.dropout_p > 0:
            keep = dropout_keep(spec, i, k0, p.shape, fq.device)
            p = p.masked_fill_(~keep, 0.0).div_(1.0 - spec.dropout_p)
        acc_grouped.baddbmm_(p.view(batch * hv, -1, k1 - k0), v[:, :, k0:k1].flatten(0, 1))
    out[:, :, q0:q1] = acc / row_sum.masked_fill(row_sum == 0, 1.0)
    lse[:, :, q0:q1] = row_max.masked_fill(row_max == float("-inf"), 0.0) + row_sum.log()


def _forward_block_carried(spec: TileSpec, i: int, tiles, fq, fk, v, out, lse,
                           scratch) -> None:
    """``_forward_block`` for a weighting other than softmax: its row loop (``carries``)
    visits the tiles in the order it needs; lse receives the statistic it saves."""
    batch, heads, dv = spec.batch, spec.heads, v.shape[-1]
    hk, hv = fk.shape[1], v.shape[1]
    q0, q1 = spec.q_range(i)
    fq_t = group_heads(fq[:, :, q0:q1], hk)
    acc = fq.new_zeros(batch, heads, q1 - q0, dv)
    acc_grouped = acc.view(batch * hv, -1, dv)
    rows = carries.for_variant(spec.variant, (batch, heads, q1 - q0, 1), fq.device, fq.dtype,
                               spec.offset)
    for k0, k1, masked in rows.order(tiles):
        idx = tile_index(spec, q0, q1, k0, k1, fq.device)
        s = tile_scores(spec, fq_t, fk[:, :, k0:k1], idx, False, scratch).contiguous()
        p = rows.step(s, tile_mask(spec, idx) if masked else None, idx, acc)
        if spec.dropout_p > 0:
            keep = dropout_keep(spec, i, k0, p.shape, fq.device)
            p = p.masked_fill_(~keep, 0.0).div_(1.0 - spec.dropout_p)
        acc_grouped.baddbmm_(p.contiguous().view(batch * hv, -1, k1 - k0),
                             v[:, :, k0:k1].flatten(0, 1))
    out[:, :, q0:q1], lse[:, :, q0:q1] = rows.finish(acc)


def _forward(spec: TileSpec, plan, fq: Tensor, fk: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """out (B, H, Nq, Dv) and lse (B, H, Nq, 1); lse is -inf on rows with no allowed key.
    fq and fk are the scores' features (``score_features``)."""
    out = fq.new_zeros(spec.batch, spec.heads, spec.nq, v.shape[-1])
    lse = fq.new_full((spec.batch, spec.heads, spec.nq, 1), float("-inf"))
    blocks_in_c = None
    if paths.choose(spec, fq)[0] is CpuPath.BLOCKS:
        blocks_in_c = native_blocks.Blocks(spec, fq, fk, v, out=out, lse=lse)

    def rows(blocks):
        if blocks_in_c is not None:
            scratch = blocks_in_c.scratch(fq)
            for i in blocks:
                blocks_in_c.run(i, plan[i], scratch)
            return
        scratch = scratch_for(spec, fq)
        block = _forward_block if spec.variant.is_softmax else _forward_block_carried
        with torch.no_grad():
            for i in blocks:
                block(spec, i, plan[i], fq, fk, v, out, lse, scratch)

    run_queued(rows, plan, keys_visited)
    return out, lse


def weights_from_lse(spec: TileSpec, fq: Tensor, fk: Tensor, lse: Tensor) -> Tensor:
    """The attention weights (B, H, Nq, Nk) recomputed tile by tile from the saved
    log-sum-exp (with the call's dropout applied, as the weights that multiplied v), for the
    scores' features fq and fk (``score_features``)."""
    weights = fq.new_zeros(spec.batch, spec.heads, spec.nq, spec.nk)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))
    softmax = spec.variant.is_softmax
    for i, tiles in enumerate(tile_plan(spec, fq.device)):
        q0, q1 = spec.q_range(i)
        fq_t = group_heads(fq[:, :, q0:q1], fk.shape[1])
        if not softmax:
            rows = carries.for_variant(spec.variant, lse[:, :, q0:q1].shape, fq.device,
                                       fq.dtype, spec.offset)
            rows.start_backward(lse[:, :, q0:q1], None)
            tiles = rows.order(tiles)
        for k0, k1, masked in tiles:
            idx = tile_index(spec, q0, q1, k0, k1, fq.device)
            if softmax:
                s = tile_scores(spec, fq_t, fk[:, :, k0:k1], idx, masked)
                p = probabilities(s, lse[:, :, q0:q1], copy=False)
            else:
                s = tile_scores(spec, fq_t, fk[:, :, k0:k1], idx, False)
                p = rows.weights(s, tile_mask(spec, idx) if masked else None, idx)
            if spec.dropout_p > 0:
                keep = dropout_keep(spec, i, k0, p.shape, fq.device)
                p = p.masked_fill_(~keep, 0.0).div_(1.0 - spec.dropout_p)
            weights[:, :, q0:q1, k0:k1] = p
    return weights


def tile_loops(pair, fq: Tensor, scale: float | None = None, fk: Tensor | None = None):
    """The pairwise term's C loops on tiles: registered for it (L1), else compiled from its
    definition (a user's term, ``kernelgen.c``), which then apply ``scale`` (a number; None
    for none) where they store; None for matrix-product terms and without a C compiler.
    With ``fk``, the loops' gradients are for these fq and fk alone (the backward pass)."""
    if pair.matrix is not None:
        return native.tile_loops(pair, fq.dtype)
    return c_target.traced_loops(pair, fq.dtype, fq.shape[-1], 1.0 if scale is None else scale,
                                 None if fk is None else (fq, fk))


def _spec(fq, fk, variant: Lowered, dropout_p, seed, grads: bool = False) -> TileSpec:
    """The call's TileSpec with the C loops of its pairwise term and score modifier. The
    modifier's loops need the term's gradients at hand (not autograd's) and a number scale
    (a tensor scale is differentiated by autograd). Without a modifier, a number scale goes
    into a traced term's loops, where they store, rather than into a pass over every tile of
    scores and of their gradients (a user's L1: three passes of 0.1 ms per 8 x 128 x 512
    tile). ``grads``: the backward pass's spec, whose loops may be specialized to fq and fk
    (``kernelgen.c.traced_loops``)."""
    into_loops = (variant.pair.matrix is None and variant.score_mod is None
                  and isinstance(variant.scale, float))
    loops = tile_loops(variant.pair, fq, variant.scale if into_loops else None,
                       fk if grads else None)
    if into_loops and loops is not None:
        variant = variant.without_scale()
    mod_loops = None
    if (variant.score_mod is not None and not isinstance(variant.scale, torch.Tensor)
            and (variant.pair.tile_grads is not None or loops is not None)):
        mod_loops = c_mod.traced_mod(variant.score_mod, fq.dtype)
    return tile_spec(fq, fk, variant, dropout_p, seed, loops, mod_loops)


def _kernel_forward(fq, fk, v, variant, dropout_p, want_weights):
    seed = draw_seed(dropout_p)
    spec = _spec(fq, fk, variant, dropout_p, seed)
    sq, sk = score_features(spec, fq, fk)
    out, lse = _forward(spec, tile_plan(spec, fq.device), sq, sk, v)
    weights = weights_from_lse(spec, sq, sk, lse) if want_weights else None
    return out, lse, weights, seed


def _kernel_backward(dout, dlse, fq, fk, v, out, lse, seed, variant, dropout_p, wanted):
    with torch.enable_grad():  # what the tracer derives from a wanted tensor keeps its graph
        spec = _spec(fq, fk, variant, dropout_p, seed, grads=True)
    extras = extra_tensors(spec, wanted)
    dfq, dfk, dv, dextras = backward(spec, tile_plan(spec, fq.device), fq, fk, v, out, lse,
                                      dout, dlse, extras)
    return dfq, dfk, dv, ops.grads_of_wanted(wanted, extras, dextras)


KERNELS = ops.EngineKernels(
    _kernel_forward, _kernel_backward,
    lse_like=lambda fq: fq.new_empty(*fq.shape[:3], 1),
)
OP = ops.define("fused_cpu", KERNELS)


def run(p: Problem) -> Result:
    fq, fk, v, variant = lower(p)
    out, lse, weights = OP.run(fq, fk, v, variant, p.dropout_p, p.return_weights)
    return Result(out.to(p.q.dtype), lse.squeeze(-1),
                  None if weights is None else weights.to(p.q.dtype))
