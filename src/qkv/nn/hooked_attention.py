"""The attention hooks of one ``MultiHeadAttention``: ``hook_q``, ``hook_k``, ``hook_v``,
``hook_attn_scores`` and ``hook_pattern``, read and written around the layer's ``attend``.

The layer's call keeps its engine (the fused CPU engines, SDPA, ...). Scores and weights
are formed only for the chosen heads and query rows, from the same definitions every engine
uses (similarity, scale, score modifier, mask, weighting): with the engine's saved
log-sum-exp a softmax row is exp(score - lse), with no second reduction over the keys, and
without gradients the rows are formed a block at a time into the one tensor handed to the
hooks, so what is kept is the (B, heads, rows, Nk) pattern itself. When a hook writes the
scores or the pattern, the chosen heads' and rows' outputs become pattern @ v, exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.problem import Problem, build_problem
from ..core.reference import accumulation_dtype, head_scores, masked_softmax
from ..core.weighting import Elementwise
from ..engines.api import attention_result

# Bytes of float32 scores formed at once when no gradient is wanted.
BLOCK_BYTES = 16 << 20


@dataclass
class HookPoint:
    """What a hook function gets beside its tensor, as TransformerLens's ``HookPoint``:
    ``name`` (``blocks.3.attn.hook_pattern``); for scores and patterns ``heads``, the query
    heads of the tensor's dim 1, and ``rows``, the (start, stop) query rows of its dim 2."""

    name: str
    heads: list[int] | None = None
    rows: tuple[int, int] | None = None

    def layer(self) -> int:
        """The layer number in the name (``blocks.3.attn.hook_q`` -> 3)."""
        numbers = [int(part) for part in self.name.split(".") if part.isdigit()]
        if not numbers:
            raise ValueError(f"{self.name} has no layer number")
        return numbers[-1]


def run_hooks(fns: list, tensor: Tensor, point: HookPoint) -> tuple[Tensor, bool]:
    """Each hook in turn: a returned tensor (same shape) replaces ``tensor``; None reads only.
    Returns the tensor and whether any hook wrote it."""
    written = False
    for fn in fns:
        new = fn(tensor, point)
        if new is None:
            continue
        if not isinstance(new, Tensor) or new.shape != tensor.shape:
            got = tuple(new.shape) if isinstance(new, Tensor) else type(new).__name__
            raise ValueError(f"hook on {point.name} must return None or a tensor of shape "
                             f"{tuple(tensor.shape)}; got {got}")
        tensor, written = new, True
    return tensor, written


def weigh(p: Problem, s: Tensor, index: Tensor, start: int) -> Tensor:
    """The weights of scores s (B, len(index), rows, Nk) (-inf: forbidden) under the layer's
    weighting, rows counted from ``start``."""
    w = p.weighting
    if w.is_softmax:
        return masked_softmax(s)[0]
    allowed = s != float("-inf")
    pos_q = torch.arange(start, start + s.shape[2], device=s.device).view(-1, 1) + p.offset
    kv_idx = torch.arange(s.shape[3], device=s.device).view(1, -1)
    if isinstance(w, Elementwise):
        # The weighting's own function, handed the chosen heads' true indices (a per-head
        # sigmoid bias reads its head).
        fn = w.score_fn(p.nk)
        safe = torch.where(allowed, s, 0.0)
        if fn is not None:
            b = torch.arange(s.shape[0], device=s.device).view(-1, 1, 1, 1)
            safe = fn(safe, b, index.view(1, -1, 1, 1), pos_q.view(1, 1, -1, 1),
                      kv_idx.view(1, 1, 1, -1)).expand(s.shape).to(s.dtype)
        return torch.where(allowed, safe, 0.0)
    return w.weights(s, allowed, pos_q, kv_idx)


def _blocked(p: Problem, q: Tensor, k: Tensor, index: Tensor, rows: tuple[int, int],
             lse: Tensor | None, weights: bool) -> Tensor:
    """Scores (or weights) of the chosen heads and rows without gradients, formed a block of
    rows at a time into one (B, len(index), rows, Nk) tensor."""
    start, stop = rows
    acc = accumulation_dtype(q.dtype)
    out = torch.empty(p.batch, len(index), stop - start, p.nk, dtype=acc, device=q.device)
    step = max(1, BLOCK_BYTES // (4 * p.batch * len(index) * p.nk))
    with torch.no_grad():
        for r0 in range(start, stop, step):
            r1 = min(stop, r0 + step)
            s = head_scores(p, q, k, index, (r0, r1), inplace=True)[0]
            if weights and lse is not None:
                # exp(s - lse) in the block's own memory; a row with no allowed key
                # (lse -inf) subtracts +inf, so its weights are 0.
                row_lse = lse.index_select(1, index)[:, :, r0:r1].unsqueeze(-1).to(acc)
                s = s.sub_(torch.where(torch.isfinite(row_lse), row_lse, float("inf"))).exp_()
            elif weights:
                s = weigh(p, s, index, r0)
            out[:, :, r0 - start:r1 - start] = s
    return out


def _replace(out: Tensor, index: Tensor, start: int, new: Tensor) -> Tensor:
    """out (B, H, Nq, Dv) with heads ``index`` and rows [start, start + rows) taken from
    new (B, len(index), rows, Dv)."""
    chosen = out.index_select(1, index)
    chosen[:, :, start:start + new.shape[2]] = new.to(out.dtype)
    return out.index_copy(1, index, chosen)


@dataclass
class AttentionHooks:
    """The hook functions of one layer, by short name (``hook_q``, ``hook_pattern``, ...),
    the layer's prefix (``blocks.3.attn``), and the query heads and rows that scores and
    patterns are formed for (None: all)."""

    prefix: str
    fns: dict[str, list]
    heads: list[int] | None = None
    rows: tuple[int, int] | None = None

    def point(self, short: str, heads=None, rows=None) -> HookPoint:
        return HookPoint(f"{self.prefix}.{short}", heads, rows)

    def _qkv(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """hook_q, hook_k, hook_v, seen as TransformerLens's (B, N, heads, D)."""
        found = []
        for short, t in (("hook_q", q), ("hook_k", k), ("hook_v", v)):
            if short in self.fns:
                new, written = run_hooks(self.fns[short], t.transpose(1, 2), self.point(short))
                t = new.transpose(1, 2) if written else t
            found.append(t)
        return found[0], found[1], found[2]

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
        """``MultiHeadAttention.attend`` with this layer's hooks: q (B, H, Nq, D), k
        (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) -> out (B, H, Nq, Dv) and the weights when
        ``return_weights``."""
        q, k, v = self._qkv(q, k, v)
        scores_fns = self.fns.get("hook_attn_scores", [])
        pattern_fns = self.fns.get("hook_pattern", [])
        result = attention_result(q, k, v, **kwargs)
        if not scores_fns and not pattern_fns:
            return result.out, result.weights
        p = build_problem(q, k, v, **kwargs)
        heads = list(range(p.heads)) if self.heads is None else self.heads
        if max(heads) >= p.heads:
            raise ValueError(f"heads must be in 0..{p.heads - 1} for {self.prefix}; got {heads}")
        rows = (0, p.nq) if self.rows is None else self.rows
        if not 0 <= rows[0] < rows[1] <= p.nq:
            raise ValueError(f"rows must be (start, stop) with 0 <= start < stop <= "
                             f"{p.nq} for {self.prefix}; got {rows}")
        index = torch.tensor(heads, device=q.device)
        # Gradients need one differentiable expression; without them rows form block-wise.
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, p.metric)
                                               if t is not None)
        lse = result.lse if p.weighting.is_softmax else None
        written, weights = False, None
        if scores_fns:
            s = head_scores(p, q, k, index, rows)[0] if grad else \
                _blocked(p, q, k, index, rows, None, weights=False)
            s, written = run_hooks(scores_fns, s, self.point("hook_attn_scores", heads, rows))
            if written:
                weights = weigh(p, s, index, rows[0])
        if pattern_fns:
            if weights is None:
                if grad:
                    weights = weigh(p, head_scores(p, q, k, index, rows)[0], index, rows[0])
                else:
                    weights = _blocked(p, q, k, index, rows, lse, weights=True)
            weights, wrote = run_hooks(pattern_fns, weights,
                                       self.point("hook_pattern", heads, rows))
            written = written or wrote
        if not written:
            return result.out, result.weights
        v_sel = v.index_select(1, index // (p.heads // p.kv_heads)).to(weights.dtype)
        return _replace(result.out, index, rows[0], weights @ v_sel), result.weights
