"""Scoring text under a language model: summed negative log-likelihood and perplexity."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ..bars import bar
from ..distributed.vocab import ShardedHead


def summed_cross_entropy(model, x: Tensor, targets: Tensor,
                         label_smoothing: float = 0.0) -> Tensor:
    """The cross-entropy (float32, summed) of a language model's logits for ids x (B, N)
    against targets (B, N). A head split by vocabulary rows (``train.fsdp``) computes it
    itself, and no rank forms the whole (B, N, V) logits."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, ShardedHead):
        return head.cross_entropy_sum(model(x, head=False), targets,
                                      label_smoothing=label_smoothing)
    return F.cross_entropy(model(x).flatten(0, 1).float(), targets.flatten(),
                           label_smoothing=label_smoothing, reduction="sum")


def token_nll(model, ids: Tensor, window: int, batch_size: int = 8,
              progress: bool = False) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of a token stream ids (N,) under a GPT, and the
    number of tokens scored. The stream is cut into non-overlapping windows of ``window``
    tokens; each window's first token is context only. ``progress``: a bar on a terminal."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens; got {window}")
    pieces = [ids[s:s + window + 1] for s in range(0, len(ids) - 1, window)]
    full = [p for p in pieces if len(p) == window + 1]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    groups += [[p] for p in pieces if 1 < len(p) < window + 1]  # the stream's short tail
    total, count = 0.0, 0
    with torch.no_grad():
        for group in bar(groups, enabled=progress, desc="scoring", unit="batch"):
            x = torch.stack(group)
            total += float(summed_cross_entropy(model, x[:, :-1], x[:, 1:]))
            count += x[:, 1:].numel()
    return total, count


def perplexity(total_nll: float, count: int) -> float:
    return math.exp(total_nll / max(1, count))
