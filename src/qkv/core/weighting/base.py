"""The base of the weightings: the row statistic an engine carries (``Carry``) and
``Weighting``, with the masking every formula shares."""

from __future__ import annotations

import enum

import torch
from torch import Tensor

from ..structure import Node


class Carry(enum.Enum):
    """The row statistic a weighting carries from one key block to the next."""

    NONE = "none"
    MAX_SUM = "max_sum"
    STICK = "stick"


class Weighting(Node):
    """Base class of the weightings: ``name``, ``carry``, and the dense weights the reference
    computes (``weights``)."""

    name: str = ""
    carry: Carry = Carry.NONE

    def weights(self, s: Tensor, allowed: Tensor, pos_q: Tensor, kv_idx: Tensor,
                heads: Tensor | None = None) -> Tensor:
        """The weights (B, H, Nq, Nk) of scores s (B, H, Nq, Nk), 0 where the bool
        ``allowed`` (broadcastable to s) is False. pos_q (Nq, 1) holds each query's key
        position (bottom-right aligned), kv_idx (1, Nk) the keys'; ``heads`` (1, H, 1, 1)
        the query heads s holds, for per-head values (None: all, in order)."""
        raise NotImplementedError

    def tensors(self) -> tuple[Tensor, ...]:
        return ()

    def check_heads(self, heads: int) -> None:
        """Raise ValueError when the weighting holds per-head values for another head count."""

    def for_context(self, length: int) -> Weighting:
        """The weighting with the sequence length it reads (sigmoid's −log N, relu's 1/N)
        fixed to ``length``, a model's context, instead of each call's Nk: a model then weighs
        a row alike in its whole forward and in KV-cache decoding, whose calls have fewer keys."""
        return self

    is_softmax: bool = False  # softmax itself: the engines' own fastest loops

    def __repr__(self) -> str:
        return f"{self.name}()"


def zero_masked(x: Tensor, allowed: Tensor) -> Tensor:
    """x with 0 where not allowed. On scores, masked entries (often -inf) never reach a
    formula, so they give neither NaN nor a gradient; on weights, a forbidden pair weighs 0."""
    return torch.where(allowed, x, torch.zeros((), dtype=x.dtype, device=x.device))
