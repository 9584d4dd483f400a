"""The fused CPU engine's row loop for each weighting other than softmax, derived from the
weighting's one definition (``core.weighting``): what a row carries from one key tile to
the next (``Carry``), in torch operations on tiles.

A query block's rows run the tiles of its key spans in the order its carry needs
(``order``): the forward through ``step`` and ``finish``, which return the output and the
statistic saved for the backward (in the place of softmax's log-sum-exp); the backward
through ``weights`` and ``grad``, which return a tile's weights and d(loss)/d(score) from
d(loss)/d(weights). Softmax keeps its own steps (``fused_cpu``, the C kernels): it is the
hot path. ``for_variant`` picks the class from the carry, and refuses one it does not know.

- ``Carry.NONE``: the weighting's function already ended the scores (``lowering``): a tile's
  weights are its scores, 0 where masked; d(loss)/d(score) is d(loss)/d(weight), which the
  modifier's gradient then carries back through the weighting's function.
- ``Carry.MAX_SUM``: a running max m (never below the weighting's floor) and the sum of its
  denominator terms, rescaled as softmax's are; the statistic is log Z.
- ``Carry.STICK``: key tiles from the nearest to the farthest; a row carries the softplus
  mass of the keys seen (the log of the stick they left) and, in the backward, the sum of
  d(loss)/d(log weight) over them, whose total is dout·out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.weighting import Carry, Normalized, StickBreaking
from .tiles import TileIndex


def _zero_where_not(t: Tensor, allowed: Tensor | None) -> Tensor:
    return t if allowed is None else t.masked_fill_(~allowed, 0.0)


def _safe(s: Tensor, allowed: Tensor | None) -> Tensor:
    """s with 0 where masked (-inf or any value there never reaches a formula)."""
    return s if allowed is None else s.masked_fill(~allowed, 0.0)


class ElementwiseRows:
    """Carry.NONE: weights are the scores; nothing to carry."""

    def __init__(self, weighting, rows_shape, device, dtype, offset: int):
        self.offset = offset

    @staticmethod
    def order(spans):
        return spans

    def step(self, s: Tensor, allowed: Tensor | None, idx: TileIndex, acc: Tensor) -> Tensor:
        return _zero_where_not(s, allowed)

    def finish(self, acc: Tensor) -> tuple[Tensor, Tensor]:
        return acc, acc.new_zeros(*acc.shape[:3], 1)

    def start_backward(self, stat: Tensor, delta: Tensor) -> None:
        pass

    def weights(self, s, allowed, idx) -> Tensor:
        return _zero_where_not(s.detach().clone(), allowed)

    def grad(self, s, p, dp, allowed, idx) -> Tensor:
        return _zero_where_not(dp, allowed)


class NormalizedRows:
    """Carry.MAX_SUM: w = e^s a(s) / (Σ e^s b(s) + eps) with a running max and sum."""

    def __init__(self, weighting: Normalized, rows_shape, device, dtype, offset: int):
        self.w = weighting
        self.row_max = torch.full(rows_shape, weighting.max_floor, device=device, dtype=dtype)
        self.row_sum = torch.zeros(rows_shape, device=device, dtype=dtype)

    @staticmethod
    def order(spans):
        return spans

    def step(self, s, allowed, idx, acc):
        low = s if allowed is None else s.masked_fill(~allowed, float("-inf"))
        new_max = torch.maximum(self.row_max, low.amax(-1, keepdim=True))
        # A row with nothing allowed yet keeps max -inf (softmax's floor): subtract 0 there.
        safe_max = new_max.masked_fill(new_max == float("-inf"), 0.0)
        num, den = self.w.terms(_safe(s, allowed), safe_max)
        num, den = _zero_where_not(num, allowed), _zero_where_not(den, allowed)
        correction = (self.row_max - safe_max).exp_()
        self.row_sum.mul_(correction).add_(den.sum(-1, keepdim=True))
        acc.mul_(correction)
        self.row_max = new_max
        return num

    def finish(self, acc):
        m = self.row_max.masked_fill(self.row_max == float("-inf"), 0.0)
        z = self.row_sum + self.w.eps * torch.exp(-m)
        empty = z == 0
        z = z.masked_fill(empty, 1.0)
        # log Z; +inf on a row with no allowed key makes its backward weights exactly 0.
        return acc / z, (m + z.log()).masked_fill(empty, float("inf"))

    def start_backward(self, stat, delta):
        self.log_z, self.delta = stat, delta

    def weights(self, s, allowed, idx):
        num, _ = self.w.terms(_safe(s.detach(), allowed), self.log_z)
        return _zero_where_not(num, allowed)

    def grad(self, s, p, dp, allowed, idx):
        s = _safe(s.detach(), allowed)
        base = _zero_where_not(torch.exp(s - self.log_z), allowed)
        num_slope, den_slope = self.w.slopes(s)
        return base.mul_(dp.mul_(num_slope).sub_(self.delta * den_slope))


class StickRows:
    """Carry.STICK: keys visited from the nearest to the farthest, carrying the softplus mass
    of the keys seen: w_ij = σ(s_ij) exp(-Σ_{l>j} softplus(s_il))."""

    def __init__(self, weighting: StickBreaking, rows_shape, device, dtype, offset: int):
        self.w, self.offset = weighting, offset
        self.spent = torch.zeros(rows_shape, device=device, dtype=dtype)

    @staticmethod
    def order(spans):
        return tuple(reversed(spans))

    def _keep(self, allowed, idx: TileIndex) -> Tensor:
        keep = self.w.in_order(idx.q + self.offset, idx.kv)
        return keep if allowed is None else keep & allowed

    def _weights(self, s, keep) -> Tensor:
        """This tile's weights, and adds its softplus mass to the carried one."""
        s = _safe(s, keep)
        spent = _zero_where_not(F.softplus(s), keep)
        after = spent.flip(-1).cumsum(-1).flip(-1).sub_(spent).add_(self.spent)
        self.spent = self.spent + spent.sum(-1, keepdim=True)
        return _zero_where_not(F.logsigmoid(s).sub_(after).exp_(), keep)

    def step(self, s, allowed, idx, acc):
        return self._weights(s, self._keep(allowed, idx))

    def finish(self, acc):
        return acc, self.spent

    def start_backward(self, stat, delta):
        self.spent = torch.zeros_like(stat)
        self.later = torch.zeros_like(stat)  # Σ over the keys seen of dp·w
        self.delta = delta

    def weights(self, s, allowed, idx):
        keep = self._keep(allowed, idx)
        self._tile_keep = keep
        return self._weights(s.detach(), keep)

    def grad(self, s, p, dp, allowed, idx):
        # d(loss)/d s_im = g_im - σ(s_im) Σ_{j<=m} g_ij, g = dp·w, and Σ_{j<=m} g_ij is the
        # row's total (dout·out) less the keys after m.
        keep = self._tile_keep
        g = dp.mul_(p)
        after = g.flip(-1).cumsum(-1).flip(-1).sub_(g).add_(self.later)
        self.later = self.later + g.sum(-1, keepdim=True)
        before = torch.sub(self.delta, after)
        beta = torch.sigmoid(_safe(s.detach(), keep))
        return _zero_where_not(g.sub_(beta.mul_(before)), keep)


_ROWS = {Carry.NONE: ElementwiseRows, Carry.MAX_SUM: NormalizedRows, Carry.STICK: StickRows}


def for_variant(variant, rows_shape, device, dtype, offset: int):
    """The row loop of ``variant``'s carry (``lowering.Lowered``) for one query block."""
    rows = _ROWS.get(variant.carry)
    if rows is None:
        raise NotImplementedError(f"the fused CPU engine has no row loop for {variant.carry}")
    return rows(variant.normalizer, rows_shape, device, dtype, offset)
