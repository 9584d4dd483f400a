"""One (query run, key piece) pair's partial result under each weighting, built from what
``qkv.attention`` returns for the pair.

- Carry.NONE: the pair's output; the shards' outputs add.
- softmax: (out_j, lse_j) from ``return_lse=True``.
- softpick: out_j from the engine's softpick, and log Z_j = log Σ|e^s − 1| over the pair's
  keys, the denominator without eps. The engines give no log Z for softpick, so log Z_j is a
  softmax's log-sum-exp over the scores s' = log|e^s − 1| (a last score modifier): the engine's
  running max keeps it finite for any s, and its backward is Z_j's gradient. out_j is
  A_j / (Z_j + eps), so out_j·(Z_j + eps) recovers the pair's numerator.
- stick-breaking: the engine breaks the stick over the keys j < i of its own bottom-right
  aligned problem, so a pair is first aligned to the global positions (``align_stick``); a
  value column of ones then gives Σ_j w_ij = 1 − (the stick the pair's keys leave).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.core.masks import Mask
from qkv.core.scores import ScoreMod
from qkv.core.weighting import Carry, Softmax, Softpick, StickBreaking, Weighting
from qkv.engines.api import attention


def refusal(weighting: Weighting) -> str | None:
    """Why the ring cannot merge ``weighting``'s shards, or None when it can."""
    if weighting.carry is Carry.NONE or type(weighting) in (Softmax, Softpick, StickBreaking):
        return None
    return (f"context parallel attention merges softmax, softpick, stick-breaking and "
            f"elementwise weightings; {weighting!r} carries {weighting.carry.value} with no "
            f"rule the ring can rebuild from the engine's outputs: run it in one process")


class LogAbsExpm1(ScoreMod):
    """s -> log|e^s − 1| = max(s, 0) + log(1 − e^−|s|), with 1 − e^−x = tanh(x/2)·(1 + e^−x):
    no overflow for large s, and no cancellation near s = 0 (tanh keeps its digits there,
    and the kernel generators trace tanh, not expm1). The floor at float32's smallest normal
    number stands in for log 0; its gradient there is 0, as |e^s − 1|'s is at s = 0."""

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        x = score.abs()
        return (score.clamp_min(0) + torch.log(torch.tanh(x * 0.5).clamp_min(_TINY))
                + torch.log(1 + torch.exp(-x)))

    def __repr__(self) -> str:
        return "log|e^s - 1|"


_TINY = float(torch.finfo(torch.float32).tiny)
LOG_ABS_EXPM1 = LogAbsExpm1()


def partial(q: Tensor, k: Tensor, v: Tensor, kwargs: dict,
            weighting: Weighting) -> tuple[Tensor, Tensor | None]:
    """(out_j, log Z_j) of one pair, log Z_j None under Carry.NONE (softmax: log Z_j is the
    lse); both differentiable under grad mode."""
    if weighting.carry is Carry.NONE:
        return attention(q, k, v, weighting=weighting, **kwargs), None
    if weighting.is_softmax:
        return attention(q, k, v, return_lse=True, **kwargs)
    out = attention(q, k, v, weighting=weighting, **kwargs)
    mods = [m for m in (kwargs["score_mod"], LOG_ABS_EXPM1) if m is not None]
    # One value column: only the log-sum-exp is read.
    _, log_z = attention(q, k, v[..., :1], return_lse=True, **dict(kwargs, score_mod=mods))
    return out, log_z


class KeysBelow(Mask):
    """``inner`` (None: every key) on the first ``n`` keys; the keys from ``n`` on, padding,
    are masked. The inner rule never sees an index past ``n - 1``: a tensor mask of the whole
    sequence would read past its end."""

    def __init__(self, inner: Mask | None, n: int):
        self.inner, self.n = inner, n

    def check(self, batch, heads, nq, nk):
        if self.inner is not None:
            self.inner.check(batch, heads, nq, self.n)

    def tensors(self):
        return () if self.inner is None else self.inner.tensors()

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        kv_idx = torch.as_tensor(kv_idx)
        real = kv_idx < self.n
        if self.inner is None:
            return real
        return real & self.inner.mask_mod(b, h, q_idx, kv_idx.clamp_max(self.n - 1), offset)

    def __repr__(self) -> str:
        return f"{self.inner!r} on {self.n} keys"


def align_stick(k: Tensor, v: Tensor, kwargs: dict, gap: int,
                nq: int) -> tuple[Tensor, Tensor, dict]:
    """k, v and kwargs of a pair made so the engine's local order (key j before query i when
    j < i + Nk − Nq) is the global one; ``gap`` = (end of the query run) − (end of the key
    piece), global positions. gap < 0: the last −gap keys come after every query and are
    dropped. gap > 0: min(gap, nq) masked keys are appended, enough that keys before every
    query of the run stay before every query."""
    if gap < 0:
        return k[:, :, :gap], v[:, :, :gap], kwargs
    pad = min(gap, nq)
    if pad == 0:
        return k, v, kwargs
    n = k.shape[2]
    k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], pad, t.shape[3])], 2) for t in (k, v))
    return k, v, dict(kwargs, mask=KeysBelow(kwargs["mask"], n))


def stick_partial(q: Tensor, k: Tensor, v: Tensor, kwargs: dict, gap: int,
                  weighting: Weighting) -> Tensor:
    """The engine's stick-breaking output of one pair, aligned to global positions; pass v
    with a last column of ones to read 1 − the stick the pair's keys leave there."""
    k, v, kwargs = align_stick(k, v, kwargs, gap, q.shape[2])
    return attention(q, k, v, weighting=weighting, **kwargs)
