"""The forget gate of forgetting attention inside a layer (Lin et al., ICLR 2025): per head
and position, f_t = σ(w·x_t + b), entering the scores as ``qkv.forget_gate``'s c_i - c_j."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.forget import ForgetGate


def gate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the cumulative sums are kept in: at least float32, as a long sum of log
    forget values in bf16 would lose the recent ones."""
    return torch.promote_types(dtype, torch.float32)


def forget_scores(logits: Tensor, cache, score_mod):
    """The layer's score modifiers with the forget gate appended.

    Args:
        logits: w·x + b of the new key positions, (B, N, H).
        cache: None, or the layer's ``KVCache`` after it took these N positions: its
            ``gates`` (B, H, max_len) keep the cumulative sums of every cached position, so
            a decoding step continues the sums of the positions before it.
        score_mod: the modifiers the layer was given (None, one, or a list).

    Returns ``[*score_mod, ForgetGate(c)]`` with c (B, H, Nk) over every key position."""
    log_f = F.logsigmoid(logits.to(gate_dtype(logits.dtype))).transpose(1, 2)
    c = log_f.cumsum(-1)
    if cache is not None:
        end = cache.length
        start = end - log_f.shape[2]
        if start > 0:
            c = c + cache.gates[:, :, start - 1:start]
        cache.gates[:, :, start:end] = c
        c = cache.gates[:, :, :end]
    if score_mod is None:
        return ForgetGate(c)
    return [*(score_mod if isinstance(score_mod, (list, tuple)) else [score_mod]), ForgetGate(c)]


def check_no_forget_gate(forget_gate: bool, kind: str) -> None:
    """A kind without softmax scores to add the gate to refuses it."""
    if forget_gate:
        raise ValueError(f"forget_gate adds to multi-head attention's scores; "
                         f"attention={kind!r} cannot take it; use attention='multihead' or "
                         f"forget_gate=False")
