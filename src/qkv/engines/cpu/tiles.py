"""What the two CPU engines share: what the fused engine computes on one tile and which
tiles it visits, and the call as both the fused (tiles) and graph (edges) engines see it
(``tile_spec``, ``extra_tensors``): the two are siblings on this module.

Everything a variant defines comes from the core's single definitions: the similarity's
pairwise term (``similarity.Pairwise``, with the fast forms registered for it), the score
modifier and the mask rule (``mask_mod``, ``tile_states``).
Nothing here restates a similarity, modifier or mask formula.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.kept import Kept
from ...core.masks import EMPTY, FULL, Mask
from ...core.problem import Problem
from ...core.scores import ScoreMod, modified_scores
from ...core.similarity import Pairwise
from ..kernelgen.c_mod import ModLoops
from ..lowering import Lowered
from . import native

BLOCK_Q = 128
# Masks are classified in key blocks of BLOCK_K; runs of visited blocks are then merged into
# spans of up to SPAN_K keys, so a sliding window visits about w keys per row while unmasked
# attention still multiplies wide tiles. Fewer, wider tiles beat skipping the mask on part of
# a span: each tile costs a few dozen Python-level calls, which two workers share one GIL for.
BLOCK_K = 128
SPAN_K = 512
# Without a mask every tile is full: square tiles of DENSE queries by DENSE keys, the same
# size as 128 x 512, run 4-8% faster forward+backward on two workers (N=4096, 8 heads): the
# gradient matmuls contract over 256 rows instead of 128. A mask keeps the narrow query blocks,
# whose spans follow it more closely (a sliding window of 256 takes 1.5x as long on 256 x 256).
DENSE = 256
# Cap on the elements of one (B, H, block_q, block_k) score tile: many heads get smaller tiles.
MAX_TILE_ELEMENTS = 1 << 23


@dataclass
class TileSpec:
    """A call as the tile loops see it: the lowered variant (``lowering.Lowered``), and the
    shapes and tiling of this call, features already applied."""

    variant: Lowered
    batch: int
    heads: int
    nq: int
    nk: int
    dropout_p: float
    seed: int
    block_q: int
    block_k: int
    span_k: int = 0  # the widest merged key span; 0 means block_k
    loops: native.TileLoops | None = None  # the pairwise term's C loops, when it has them
    mod_loops: ModLoops | None = None  # the score modifier's C loops, when it has them

    @property
    def pair(self) -> Pairwise:
        return self.variant.pair

    @property
    def scale(self) -> float | Tensor | None:
        """Broadcastable to a tile's scores (B, H, bq, bk)."""
        return self.variant.scale_bhqk

    @property
    def score_mod(self) -> ScoreMod | None:
        return self.variant.score_mod

    @property
    def mask(self) -> Mask | None:
        return self.variant.mask

    @property
    def offset(self) -> int:
        return self.nk - self.nq

    @property
    def scores_lifted(self) -> bool:
        """Whether tiles score the term's lifted features (``score_features``): only with its
        tile gradients at hand, which read the features themselves."""
        return self.pair.lift is not None and self.pair.tile_grads is not None

    @property
    def mod_scale(self) -> float:
        """The scale a score modifier's C loops apply first (1.0 when it was folded)."""
        return 1.0 if self.scale is None else self.scale

    def q_range(self, i: int) -> tuple[int, int]:
        return i * self.block_q, min(self.nq, (i + 1) * self.block_q)


def block_sizes(batch: int, heads: int, nq: int, nk: int,
                dense: bool = False) -> tuple[int, int, int]:
    """(block_q, block_k, span_k): the defaults (``DENSE`` square tiles when there is no
    mask), shrunk for small N and for many (batch, head) pairs."""
    block_q, span_k = min(DENSE if dense else BLOCK_Q, nq), min(DENSE if dense else SPAN_K, nk)
    while batch * heads * block_q * span_k > MAX_TILE_ELEMENTS and block_q > 16:
        block_q //= 2
    while batch * heads * block_q * span_k > MAX_TILE_ELEMENTS and span_k > 64:
        span_k //= 2
    return max(1, block_q), max(1, min(BLOCK_K, span_k)), max(1, span_k)


Span = tuple[int, int, bool]


_plans = Kept(64)


def tile_plan(spec: TileSpec, device) -> tuple[tuple[Span, ...], ...]:
    """For each query block, the key spans (k0, k1, masked) to visit.

    A key block EMPTY for every (batch, head) is skipped; neighbouring visited blocks merge
    into spans of up to ``span_k`` keys, and a span evaluates the mask rule unless all its
    blocks are FULL for every (batch, head). A mask with a ``Mask.layout_key`` (causal,
    sliding windows; segments and padding over the same unchanged tensor) keeps its plan for
    later calls of the same shape: classifying its tiles would be a quarter of a decode
    step's host time (docs/performance.md, "CPU: host time")."""
    rule = ("none",) if spec.mask is None else spec.mask.layout_key()
    if rule is None:
        return _make_plan(spec, device)
    key = (rule, spec.batch, spec.heads, spec.nq, spec.nk, spec.block_q, spec.block_k,
           spec.span_k)
    return _plans.get_or_make(key, lambda: _make_plan(spec, device))


def _make_plan(spec: TileSpec, device) -> tuple[tuple[Span, ...], ...]:
    qb, kb = -(-spec.nq // spec.block_q), -(-spec.nk // spec.block_k)
    if spec.mask is None:
        visit, masked = [[True] * kb] * qb, [[False] * kb] * qb
    else:
        states = spec.mask.tile_states(
            spec.batch, spec.heads, spec.nq, spec.nk, spec.block_q, spec.block_k, device
        ).flatten(0, 1)
        visit = (states != EMPTY).any(0).tolist()
        masked = (states != FULL).any(0).tolist()
    return tuple(_spans(spec, visit[i], masked[i]) for i in range(qb))


def _spans(spec: TileSpec, visit: list[bool], masked: list[bool]) -> tuple[Span, ...]:
    width = max(spec.span_k, spec.block_k)
    spans: list[Span] = []
    for j, (seen, needs_mask) in enumerate(zip(visit, masked, strict=True)):
        if not seen:
            continue
        k0, k1 = j * spec.block_k, min(spec.nk, (j + 1) * spec.block_k)
        start, end, state = spans[-1] if spans else (0, -1, False)
        if end == k0 and k1 - start <= width:
            spans[-1] = (start, k1, state or needs_mask)
        else:
            spans.append((k0, k1, needs_mask))
    return tuple(spans)


def group_heads(t: Tensor, groups: int) -> Tensor:
    """(B, H, n, X) -> (B, groups, (H / groups)·n, X): head h = g·(H/groups) + r becomes rows
    r·n ... of group g, so grouped K/V heads multiply without being repeated."""
    b, h, n, x = t.shape
    return t.reshape(b, groups, (h // groups) * n, x)


@dataclass
class TileIndex:
    """Broadcastable index tensors of one tile: b (B,1,1,1), h (1,H,1,1), q (1,1,bq,1),
    kv (1,1,1,bk); q0 and k0 are the first query and key positions."""

    b: Tensor
    h: Tensor
    q: Tensor
    kv: Tensor
    q0: int
    k0: int


def tile_index(spec: TileSpec, q0: int, q1: int, k0: int, k1: int, device) -> TileIndex:
    return TileIndex(
        _arange(0, spec.batch, device).view(-1, 1, 1, 1),
        _arange(0, spec.heads, device).view(1, -1, 1, 1),
        _arange(q0, q1, device).view(1, 1, -1, 1),
        _arange(k0, k1, device).view(1, 1, 1, -1),
        q0, k0,
    )


@functools.lru_cache(maxsize=1024)
def _arange(start: int, end: int, device) -> Tensor:
    # Tiles repeat the same few ranges in every call and in the backward; a modifier only reads
    # these (never writes them), so one tensor per range is shared. A normal tensor even when
    # first made under inference mode, so a later call may save it for backward.
    with torch.inference_mode(False):
        return torch.arange(start, end, device=device)


def tile_shape(spec: TileSpec, idx: TileIndex, batch: int) -> tuple[int, int, int, int]:
    return batch, spec.heads, idx.q.shape[2], idx.kv.shape[3]


def analytic_kernel(spec: TileSpec) -> bool:
    """Whether the pairwise term's tile gradients are at hand (registered torch matmuls, or
    C loops), rather than by autograd through its torch form."""
    return spec.pair.tile_grads is not None or spec.loops is not None


def tile_raw(spec: TileSpec, fq_t: Tensor, fk_t: Tensor, scratch: Tensor | None = None) -> Tensor:
    """The pairwise term on one tile, grouped: (B, Hk, (H/Hk)·bq, bk), written into the
    front of ``scratch`` (a flat buffer a worker reuses for every tile) when given. A term
    with C loops runs them (the same formula, vectorized across keys; see ``native``) unless
    autograd must see it. fq_t and fk_t are ``score_features``' slices."""
    b, hk, rows, _ = fq_t.shape
    out = None
    if scratch is not None:
        out = scratch[: b * hk * rows * fk_t.shape[2]].view(b, hk, rows, fk_t.shape[2])
    loops = spec.loops
    if loops is not None and not (torch.is_grad_enabled() and (fq_t.requires_grad or
                                                               fk_t.requires_grad)):
        return loops.scores(fq_t, fk_t, out).view(b, hk, rows, fk_t.shape[2])
    if spec.scores_lifted:
        return spec.pair.lifted_matrix(fq_t, fk_t, out=out)
    return spec.pair.scores(fq_t, fk_t, out=out)


def score_features(spec: TileSpec, fq: Tensor, fk: Tensor) -> tuple[Tensor, Tensor]:
    """The features the tiles' scores read (``tile_raw``): the term's lifted ones, computed
    once here, when ``spec.scores_lifted``; else fq and fk."""
    return spec.pair.lift(fq, fk) if spec.scores_lifted else (fq, fk)


def scratch_for(spec: TileSpec, like: Tensor) -> Tensor:
    """One worker's flat scores buffer, large enough for its widest tile."""
    return like.new_empty(spec.batch * spec.heads * spec.block_q * max(spec.span_k, spec.block_k))


def mod_tile(spec: TileSpec, raw: Tensor, idx: TileIndex, out: Tensor) -> Tensor:
    """Scale and score modifier of one contiguous tile (B, H, bq, bk) by the modifier's C
    loops, into ``out`` (which may be ``raw``)."""
    return spec.mod_loops.scores(raw, out, idx.q0, idx.k0, spec.offset, spec.mod_scale)


def modify_scores(spec: TileSpec, raw: Tensor, idx: TileIndex, masked: bool) -> Tensor:
    """``scores.modified_scores`` on one tile (B, H, bq, bk): scale, score modifier, and the
    mask when the tile is ``masked``; in place outside autograd, where a modifier with C
    loops runs them."""
    if spec.mod_loops is not None and not torch.is_grad_enabled():
        raw = raw.contiguous()
        raw = mod_tile(spec, raw, idx, raw)
        return modified_scores(raw, (idx.b, idx.h, idx.q, idx.kv), spec.offset,
                               mask=spec.mask if masked else None, inplace=True)
    return modified_scores(raw, (idx.b, idx.h, idx.q, idx.kv), spec.offset, scale=spec.scale,
                           score_mod=spec.score_mod, mask=spec.mask if masked else None,
                           inplace=not torch.is_grad_enabled())


def tile_mask(spec: TileSpec, idx: TileIndex) -> Tensor:
    """The mask rule on one tile: bool, broadcastable to (B, H, bq, bk), True where allowed."""
    return torch.as_tensor(spec.mask.mask_mod(idx.b, idx.h, idx.q, idx.kv, spec.offset))


def tile_scores(spec: TileSpec, fq_t: Tensor, fk_t: Tensor, idx: TileIndex, masked: bool,
                scratch: Tensor | None = None) -> Tensor:
    """Scores (B, H, bq, bk) of one tile, -inf where the mask forbids.

    fq_t: (B, Hk, (H/Hk)·bq, D) query features grouped by key head; fk_t: (B, Hk, bk, D)."""
    raw = tile_raw(spec, fq_t, fk_t, scratch).reshape(tile_shape(spec, idx, fq_t.shape[0]))
    return modify_scores(spec, raw, idx, masked)


def dropout_keep(spec: TileSpec, i: int, k0: int, shape, device) -> Tensor:
    """The keep mask of the tile of query block i whose keys start at k0, regenerated bit for
    bit by the backward pass: each tile draws from its own generator seeded by the call's seed
    and the tile's position."""
    gen = torch.Generator(device=device).manual_seed(spec.seed + i * spec.nk + k0)
    return torch.rand(shape, generator=gen, device=device) >= spec.dropout_p


def keys_visited(spans: list[Span]) -> int:
    """A query block's work for ``workers.run_queued`` and ``run_in_chains``: the keys its
    spans visit."""
    return sum(k1 - k0 for k0, k1, _ in spans)


def elementwise_needs_grad(spec: TileSpec) -> bool:
    """Whether the elementwise part of the scores (scale, modifier) has anything to
    differentiate by autograd: not when the modifier's C loops give its gradients."""
    return spec.mod_loops is None and (spec.score_mod is not None or
                                       isinstance(spec.scale, Tensor))


def grad_sums(tensors, count: int) -> list[Tensor | None]:
    """One chain's gradient sums: a contiguous zero buffer per tensor (whatever its layout:
    results are accumulated into batched views of it), then ``count`` extras not yet seen."""
    return [torch.zeros_like(t, memory_format=torch.contiguous_format) for t in tensors] + [
        None] * count


def add_grads(sums: list[Tensor | None], start: int, grads) -> None:
    """Add ``grads`` (None where unused) into ``sums[start:]`` in place."""
    for e, g in enumerate(grads, start=start):
        if g is not None:
            sums[e] = g if sums[e] is None else sums[e] + g


# -- shared by the fused (tiles) and graph (edges) CPU engines --------------------------------
def cpu_why_not(p: Problem) -> str | None:
    """What rules out both CPU engines (tiles and graph edges)."""
    if p.q.device.type != "cpu":
        return f"the fused CPU engines run CPU tensors; got device {p.q.device}"
    return None


def draw_seed(dropout_p: float) -> int:
    """Dropout's seed for one call (0 without dropout): each tile's keep mask derives from it,
    so the backward pass regenerates the same masks."""
    return int(torch.randint(0, 2**62, ())) if dropout_p > 0 else 0


def tile_spec(fq: Tensor, fk: Tensor, variant: Lowered, dropout_p: float, seed: int,
              loops=None, mod_loops=None) -> TileSpec:
    """The call as the tile loops (and the graph engine's chunks) see it, for features
    fq (B, H, Nq, D) and fk (B, Hk, Nk, D). The mask's checks run here too, at run time,
    so a compiled call refuses bad values with the same message as an eager one."""
    batch, heads, nq = fq.shape[:3]
    nk = fk.shape[2]
    if variant.mask is not None:
        variant.mask.check(batch, heads, nq, nk)
    block_q, block_k, span_k = block_sizes(batch, heads, nq, nk, variant.mask is None)
    return TileSpec(variant=variant, batch=batch, heads=heads, nq=nq, nk=nk,
                    dropout_p=dropout_p, seed=seed, block_q=block_q, block_k=block_k,
                    span_k=span_k, loops=loops, mod_loops=mod_loops)


def extra_tensors(spec: TileSpec, wanted: list[Tensor]) -> list[Tensor]:
    """The tensors besides q, k, v that the tile loops give gradients to, once each: the
    wanted ones, except that compiled loops (a term's, a score modifier's) read the tensors
    their trace captured, which stand in for the term's or modifier's own."""
    traced = spec.loops is not None and spec.loops.tensors
    covered = {id(t) for t in spec.pair.tensors()} if traced else set()
    mod = spec.mod_loops.tensors if spec.mod_loops is not None else ()
    if spec.mod_loops is not None:
        covered |= {id(t) for t in spec.score_mod.tensors()}
    extras = [*(spec.loops.tensors if traced else ()), *mod,
              *(t for t in wanted if id(t) not in covered)]
    unique = {id(t): t for t in extras if t.is_floating_point() and t.requires_grad}
    return list(unique.values())
