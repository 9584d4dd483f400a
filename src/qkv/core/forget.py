"""Forgetting attention's score modifier (Lin et al., "Forgetting Transformer", ICLR 2025).

A forget gate f_t in (0, 1) per head and position decays the weight of key j seen from query
i by the product f_{j+1} ... f_i, which in log space adds c_i - c_j to the score, with c the
cumulative sum of log f along positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .scores import ScoreMod


def _index(c: Tensor, b, h, position):
    """``c[b, h, position]`` for c (B, H, N) broadcastable over batch and heads: a dimension
    of size 1 is read at 0 whatever its index."""
    return c[b if c.shape[0] > 1 else 0, h if c.shape[1] > 1 else 0, position]


class ForgetGate(ScoreMod):
    """score + c[b, h, position(q)] - c[b, h, kv_idx], with ``cumulative`` c (B, H, Nk) the
    cumulative sums of log f over the key positions (B or H may be 1 to broadcast). A query's
    position is bottom-right aligned (``q_idx + offset``), so a KV-cache step's queries read
    their own sums. Gradients reach c, and through autograd whatever c was computed from."""

    def __init__(self, cumulative: Tensor):
        if not isinstance(cumulative, Tensor) or cumulative.dim() != 3 or (
                not cumulative.is_floating_point()):
            got = (f"shape {tuple(cumulative.shape)}, {cumulative.dtype}"
                   if isinstance(cumulative, Tensor) else type(cumulative).__name__)
            raise ValueError(f"forget_gate: cumulative must be a float tensor (B, H, N); got "
                             f"{got}")
        self.cumulative = cumulative

    def tensors(self):
        return (self.cumulative,)

    def check_heads(self, heads: int) -> None:
        if self.cumulative.shape[1] not in (1, heads):
            raise ValueError(
                f"forget_gate has log_f for {self.cumulative.shape[1]} heads but the attention "
                f"has {heads} query heads")

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        c = self.cumulative.to(score)
        return score + (_index(c, b, h, q_idx + offset) - _index(c, b, h, kv_idx))

    def __repr__(self) -> str:
        return f"forget_gate({tuple(self.cumulative.shape)})"


def forget_gate(log_f: Tensor) -> ForgetGate:
    """Forgetting attention's modifier from log_f (B, H, N), the log forget value of each
    head at each key position (``logsigmoid`` of the gate's logits; B or H may be 1). Use it
    with a causal mask: query i at key position i + Nk - Nq (bottom-right aligned) gets
    score + sum of log_f over positions j+1..i for key j. The cumulative sum is taken once
    here, in at least float32, differentiably, so gradients reach log_f."""
    if not isinstance(log_f, Tensor) or log_f.dim() != 3 or not log_f.is_floating_point():
        got = (f"shape {tuple(log_f.shape)}, {log_f.dtype}" if isinstance(log_f, Tensor)
               else type(log_f).__name__)
        raise ValueError(f"forget_gate: log_f must be a float tensor (B, H, N); got {got}")
    wide = torch.promote_types(log_f.dtype, torch.float32)
    return ForgetGate(log_f.to(wide).cumsum(-1))
