"""The fused CPU engine's backward pass on tiles: one loop, composed with the way the call's
tile gradients are found (``TileGrads``), chosen once per call.

Each tile's scores are recomputed from the saved log-sum-exp; d(loss)/d(scores) is the
softmax's p (dp - delta). What turns that into gradients of the term's features, of the score
modifier's tensors and of a tensor scale depends only on the call, so each way is a small
class with two steps, ``scores`` and ``raw_grad`` (``tile_grads`` chooses):

- ``TermByAutograd``, when the term has no tile gradients (no matmul form, no C loops):
  the scores run under autograd from the features, which gives all the gradients;
- ``ElementwiseByAutograd``, for a modifier without C loops or a tensor scale: the term's
  scores, then scale, modifier and mask under autograd, which gives the term scores'
  gradient and the modifier's tensors';
- ``ModifierLoops``, for a modifier with C loops (``kernelgen.c_mod``): the loops write the
  modified scores and give their gradient (and their tensors'), or keep the slope in the
  same pass for the softmax's gradient to apply;
- ``ScaleOnly``, with no modifier: the term's scores scaled in place, ds times the scale.

The term's own gradients then come from its registered tile gradients (matmuls) or its C
loops (``add_pair_grads``), except for ``TermByAutograd``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import carries, native, native_blocks, paths
from .paths import CpuPath
from .tiles import (
    TileIndex,
    TileSpec,
    add_grads,
    analytic_kernel,
    dropout_keep,
    elementwise_needs_grad,
    grad_sums,
    group_heads,
    keys_visited,
    mod_tile,
    modify_scores,
    score_features,
    scratch_for,
    tile_index,
    tile_mask,
    tile_raw,
    tile_scores,
)
from .workers import run_in_chains, sum_chains

_LOG2E = 1.4426950408889634


def exp_(x: Tensor) -> Tensor:
    """exp(x) in place, as exp2(x·log2 e). torch's exp takes a slow path (about 30x) on inputs
    below about -88, which far ALiBi keys and masked -inf fill on much of a tile; exp2 does
    not, and is faster on ordinary inputs too."""
    return x.mul_(_LOG2E).exp2_()


def probabilities(s: Tensor, lse: Tensor, copy: bool, allowed: Tensor | None = None) -> Tensor:
    """exp(s - lse) for scores s (B, H, bq, bk) and lse (B, H, bq, 1) (+inf on rows with no
    allowed key, giving 0), and 0 where the bool mask ``allowed`` forbids; in s's memory
    unless ``copy`` (s is part of an autograd graph)."""
    s = s.detach().clone() if copy else s.contiguous()
    if native.available(s.dtype):
        return native.exp_sub_rows(s, lse, allowed)
    if allowed is not None:
        s = s.masked_fill_(~allowed, float("-inf"))
    return exp_(s.sub_(lse))


def softmax_grad(p: Tensor, dp: Tensor, delta: Tensor, slope: Tensor | None = None,
                 scale: float = 1.0) -> Tensor:
    """d(loss)/d(scores) = p (dp - delta) of a tile, in dp's memory; with ``slope`` (from a
    modifier's C loops, which exist only with the C kernels), times slope · scale."""
    if native.available(p.dtype):
        return native.softmax_grad_rows(p, dp, delta, slope, scale)
    return dp.sub_(delta).mul_(p)


def add_tensor_grads(sums: list, extras, tensors, grads) -> None:
    """Add the gradients of ``tensors`` (some of ``extras``) into their place in ``sums``
    (2 + their index in ``extras``)."""
    for tensor, grad in zip(tensors, grads, strict=True):
        for e, extra in enumerate(extras):
            if extra is tensor:
                add_grads(sums, 2 + e, [grad])  # float64 sums; cast once at the end


def add_pair_grads(spec: TileSpec, draw: Tensor, fq_t: Tensor, fk_t: Tensor, dq: Tensor,
                   dk: Tensor, sums: list, extras) -> None:
    """Add the pairwise term's gradients for the query and key tile into dq (like fq_t) and
    dk (like fk_t), and those of the tensors its C loops read into their place in ``sums``
    (2 + their index in ``extras``), from draw = d(loss)/d(term scores)
    (B, Hk, (H/Hk)·bq, bk): the torch derivative registered with the term, else its C loops
    (``analytic_kernel`` said which)."""
    if spec.pair.tile_grads is not None:
        spec.pair.tile_grads(draw, fq_t, fk_t, dq, dk)
        return
    tensor_grads = spec.loops.add_grads(draw, fq_t, fk_t, dq, dk)
    add_tensor_grads(sums, extras, spec.loops.tensors, tensor_grads)


@dataclass
class Tile:
    """One tile of a query block in the backward: its index, the features it reads (the
    term's own, f*, and those its scores read, s*: lifted for L2), grouped by key head, and
    where its gradients go: dfq (like fq), dfk (like fk), the extras' sums."""

    idx: TileIndex
    shape: tuple[int, int, int, int]
    masked: bool
    fq: Tensor
    fk: Tensor
    sq: Tensor
    sk: Tensor
    dfq: Tensor
    dfk: Tensor
    sums: list
    extras: list
    scratch: list


class ScaleOnly:
    """No modifier, or one with nothing to differentiate: the scores are scaled in place and
    the mask goes to the probabilities."""

    graph = False  # the scores carry no autograd graph: the mask is applied apart

    def __init__(self, spec: TileSpec):
        self.spec = spec

    def scores(self, t: Tile):
        raw = tile_raw(self.spec, t.sq, t.sk, t.scratch[0]).view(t.shape)
        return modify_scores(self.spec, raw, t.idx, False), raw

    def softmax_grad(self, p, dp, delta, raw):
        return softmax_grad(p, dp, delta)

    def with_slope(self, ds, raw):
        """d(loss)/d(scores) ``ds`` of another weighting, times the slope the scores kept."""
        return ds

    def raw_grad(self, t: Tile, s, raw, ds):
        return ds if self.spec.scale is None else ds.mul_(self.spec.scale)


class ModifierLoops(ScaleOnly):
    """A modifier with C loops: they write the modified scores (beside the raw ones when its
    gradient reads them) and give the raw scores' gradient, and its tensors'. When its slope
    is all the gradient needs, the forward pass keeps it and the softmax's gradient applies it
    in the same pass (``keeps_slope``)."""

    def scores(self, t: Tile):
        spec, mod = self.spec, self.spec.mod_loops
        raw = tile_raw(spec, t.sq, t.sk, t.scratch[0]).view(t.shape)
        out = t.scratch[2][: raw.numel()].view(t.shape) if len(t.scratch) > 2 else raw
        if mod.keeps_slope:  # raw <- d mod / d score, from the same pass
            return mod.scores_ds(raw, out, t.idx.q0, t.idx.k0, spec.offset, spec.mod_scale), raw
        return mod_tile(spec, raw, t.idx, out), raw

    def softmax_grad(self, p, dp, delta, raw):
        if self.spec.mod_loops.keeps_slope:
            return softmax_grad(p, dp, delta, raw, self.spec.mod_scale)
        return softmax_grad(p, dp, delta)

    def with_slope(self, ds, raw):
        if not self.spec.mod_loops.keeps_slope:
            return ds
        ds = ds.mul_(raw)
        return ds if self.spec.mod_scale == 1.0 else ds.mul_(self.spec.mod_scale)

    def raw_grad(self, t: Tile, s, raw, ds):
        spec, mod = self.spec, self.spec.mod_loops
        if mod.keeps_slope:
            return ds  # already the raw scores' gradient
        if mod.grads_are_scale:
            return ds if spec.scale is None else ds.mul_(spec.scale)
        grads = mod.grads(raw, ds, t.idx.q0, t.idx.k0, spec.offset, spec.mod_scale)
        add_tensor_grads(t.sums, t.extras, mod.tensors, grads)
        return ds


class ElementwiseByAutograd(ScaleOnly):
    """A modifier without C loops, or a tensor scale: the elementwise part (scale, modifier,
    mask) of each tile runs under autograd from the raw term scores, which gives their
    gradient and the modifier's tensors'."""

    graph = True

    def scores(self, t: Tile):
        raw = tile_raw(self.spec, t.sq, t.sk, t.scratch[0]).view(t.shape).requires_grad_()
        with torch.enable_grad():
            return modify_scores(self.spec, raw, t.idx, t.masked), raw

    def raw_grad(self, t: Tile, s, raw, ds):
        if not s.requires_grad:  # a modifier that ignores the score and reads no tensor
            return None
        found = torch.autograd.grad(s, (raw, *t.extras), ds, allow_unused=True)
        add_grads(t.sums, 2, found[1:])
        return found[0]  # None: a modifier that ignores the score


class TermByAutograd(ElementwiseByAutograd):
    """A term without tile gradients (L1 without its C loops, a user's term that does not
    trace): autograd differentiates the whole tile from the features."""

    def scores(self, t: Tile):
        with torch.enable_grad():
            leaves = (t.fq.detach().requires_grad_(), t.fk.detach().requires_grad_())
            return tile_scores(self.spec, *leaves, t.idx, t.masked), leaves

    def raw_grad(self, t: Tile, s, leaves, ds):
        if not s.requires_grad:
            return None
        found = torch.autograd.grad(s, (*leaves, *t.extras), ds, allow_unused=True)
        add_grads(t.sums, 2, found[2:])
        if found[0] is not None:
            t.dfq += found[0]
            t.dfk += found[1]
        return None  # the term's gradients are in


def tile_grads(spec: TileSpec) -> ScaleOnly:
    """The call's way to its tile gradients (the table in this module's docstring)."""
    if not analytic_kernel(spec):
        return TermByAutograd(spec)
    if elementwise_needs_grad(spec):
        return ElementwiseByAutograd(spec)
    if spec.mod_loops is not None:
        return ModifierLoops(spec)
    return ScaleOnly(spec)


def _weights_grad(spec: TileSpec, i: int, t: Tile, p: Tensor, do_t: Tensor, v: Tensor,
                  sums: list, scratch: list) -> Tensor:
    """d(loss)/d(weights) of tile ``t`` of query block i, dp = dout·vᵀ (B, H, bq, bk), in the
    second scratch buffer; adds the tile's weights p (dropped as in the forward) times dout
    into the dv sums. Dropout scales dp as it scales the weights."""
    batch, hv = spec.batch, v.shape[1]
    k0, k1 = t.idx.k0, t.idx.k0 + t.shape[3]
    dp = scratch[1][: p.numel()].view(batch, hv, -1, k1 - k0)
    torch.matmul(do_t, v[:, :, k0:k1].transpose(-1, -2), out=dp)
    dp = dp.view(t.shape)
    weights = p
    if spec.dropout_p > 0:
        keep = dropout_keep(spec, i, k0, p.shape, p.device)
        weights = p.masked_fill(~keep, 0.0).div_(1.0 - spec.dropout_p)
        dp = dp.masked_fill_(~keep, 0.0).div_(1.0 - spec.dropout_p)
    # dv is summed transposed, (B, Hv, Dv, Nk): doᵀ·p multiplies faster than pᵀ·do
    # (docs/performance.md, "CPU: inner loops").
    sums[1][..., k0:k1].flatten(0, 1).baddbmm_(
        do_t.flatten(0, 1).transpose(1, 2), weights.view(batch * hv, -1, k1 - k0))
    return dp


def _backward_block(grads: ScaleOnly, i, tiles, saved, dout, delta, dfq, sums, extras,
                    scratch) -> None:
    """Recompute query block i's tiles; write its rows of dfq, add to the key-side sums
    [dfk, dv transposed, *extras] (``grad_sums``). ``scratch`` holds the worker's flat tile
    buffers: raw scores, d(loss)/d(weights), and with a modifier's C loops whose gradient
    reads the raw scores, the modified ones. The kernels stay out of autograd: ``grads`` says
    what runs under it."""
    spec = grads.spec
    fq, fk, sq, sk, v, lse = saved
    batch, heads = spec.batch, spec.heads
    hk, hv = fk.shape[1], v.shape[1]
    q0, q1 = spec.q_range(i)
    fq_t, sq_t = group_heads(fq[:, :, q0:q1], hk), group_heads(sq[:, :, q0:q1], hk)
    do_t = group_heads(dout[:, :, q0:q1], hv)
    lse_t, delta_t = lse[:, :, q0:q1], delta[:, :, q0:q1]
    dfq_t = torch.zeros_like(fq_t, memory_format=torch.contiguous_format)
    for k0, k1, masked in tiles:
        idx = tile_index(spec, q0, q1, k0, k1, fq.device)
        t = Tile(idx, (batch, heads, q1 - q0, k1 - k0), masked, fq_t, fk[:, :, k0:k1], sq_t,
                 sk[:, :, k0:k1], dfq_t, sums[0][:, :, k0:k1], sums, extras, scratch)
        s, kept = grads.scores(t)
        allowed = tile_mask(spec, idx) if masked and not grads.graph else None
        p = probabilities(s, lse_t, copy=grads.graph, allowed=allowed)
        dp = _weights_grad(spec, i, t, p, do_t, v, sums, scratch)
        ds = grads.raw_grad(t, s, kept, grads.softmax_grad(p, dp, delta_t, kept))
        if ds is not None:
            add_pair_grads(spec, group_heads(ds, hk), t.fq, t.fk, dfq_t, t.dfk, sums, extras)
    dfq[:, :, q0:q1] = dfq_t.view(batch, heads, q1 - q0, -1)


def _backward_block_carried(grads: ScaleOnly, i, tiles, saved, dout, delta, dfq, sums, extras,
                            scratch) -> None:
    """``_backward_block`` for a weighting other than softmax: its row loop (``carries``)
    gives each tile's weights and d(loss)/d(scores), in the order it visits them."""
    spec = grads.spec
    fq, fk, sq, sk, v, lse = saved
    batch, heads = spec.batch, spec.heads
    hk, hv = fk.shape[1], v.shape[1]
    q0, q1 = spec.q_range(i)
    fq_t, sq_t = group_heads(fq[:, :, q0:q1], hk), group_heads(sq[:, :, q0:q1], hk)
    do_t = group_heads(dout[:, :, q0:q1], hv)
    dfq_t = torch.zeros_like(fq_t, memory_format=torch.contiguous_format)
    rows = carries.for_variant(spec.variant, lse[:, :, q0:q1].shape, fq.device, fq.dtype,
                               spec.offset)
    rows.start_backward(lse[:, :, q0:q1], delta[:, :, q0:q1])
    for k0, k1, masked in rows.order(tiles):
        idx = tile_index(spec, q0, q1, k0, k1, fq.device)
        t = Tile(idx, (batch, heads, q1 - q0, k1 - k0), masked, fq_t, fk[:, :, k0:k1], sq_t,
                 sk[:, :, k0:k1], dfq_t, sums[0][:, :, k0:k1], sums, extras, scratch)
        s, kept = grads.scores(t)
        allowed = tile_mask(spec, idx) if masked else None
        p = rows.weights(s, allowed, idx)
        dp = _weights_grad(spec, i, t, p, do_t, v, sums, scratch)
        ds = grads.raw_grad(t, s, kept, grads.with_slope(rows.grad(s, p, dp, allowed, idx), kept))
        if ds is not None:
            add_pair_grads(spec, group_heads(ds, hk), t.fq, t.fk, dfq_t, t.dfk, sums, extras)
    dfq[:, :, q0:q1] = dfq_t.view(batch, heads, q1 - q0, -1)


def backward(spec: TileSpec, plan, fq, fk, v, out, lse, dout, dlse, extras):
    """Gradients for fq, fk, v and each tensor in ``extras`` (those requiring grad), from
    those of out and of lse (None when nothing read lse). d lse / d score = p, so a gradient
    on lse joins the softmax's: d(loss)/d(score) = p (dp - (delta - dlse)). Whole query
    blocks run in C where ``native_blocks`` can, else the tiles above."""
    delta = (dout * out).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse
    # Rows with no allowed key: +inf makes exp(score - lse) exactly 0, so their gradients are 0.
    saved = (fq, fk, *score_features(spec, fq, fk), v,
             lse.masked_fill(lse == float("-inf"), float("inf")))
    dfq = torch.zeros_like(fq, memory_format=torch.contiguous_format)  # rows the C blocks write
    needs_raw = spec.mod_loops is not None and spec.mod_loops.needs_raw

    blocks_in_c = None
    if paths.choose(spec, fq, extras)[0] is CpuPath.BLOCKS:
        blocks_in_c = native_blocks.Blocks(spec, fq, fk, v, scores=saved[2:4], lse=saved[-1],
                                           dout=dout, delta=delta, dq=dfq)
    grads = tile_grads(spec)
    on_tiles = _backward_block if spec.variant.is_softmax else _backward_block_carried

    def block(i, sums, scratch):
        if blocks_in_c is not None:
            blocks_in_c.run(i, plan[i], scratch, sums[0], sums[1])
        else:
            on_tiles(grads, i, plan[i], saved, dout, delta, dfq, sums, extras, scratch)

    def start_worker():
        if blocks_in_c is not None:
            return blocks_in_c.scratch(fq)
        return [scratch_for(spec, fq) for _ in range(3 if needs_raw else 2)]

    sums = run_in_chains(
        block, plan, keys_visited,
        start_chain=lambda: grad_sums((fk, v.transpose(-1, -2)), len(extras)),  # dv transposed
        start_worker=start_worker,
        chain_bytes=(fk.numel() + v.numel()) * fk.element_size())
    dfk, dv_t, *dextras = sum_chains(sums, buffers=2)
    return dfq, dfk, dv_t.transpose(-1, -2).contiguous(), dextras
