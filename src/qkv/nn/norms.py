"""Normalization layers around each block: LayerNorm (the paper's) and RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..engines.cpu import row_ops

NORMS = ("layernorm", "rmsnorm")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight over the last dim (Zhang & Sennrich, 2019)."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model))

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            # Decoding's few rows in one C call; torch's CPU rms_norm is seven operations.
            y = row_ops.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps) if y is None else y
        # Accumulate in float32 at least, so bf16/fp16 inputs keep the same normalization.
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        norm = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * norm).to(x.dtype) * self.weight


def make_norm(kind: str, d_model: int, eps: float = 1e-5, bias: bool = True) -> nn.Module:
    """"layernorm" -> nn.LayerNorm, "rmsnorm" -> RMSNorm."""
    if kind == "layernorm":
        return nn.LayerNorm(d_model, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(d_model, eps=eps)
    raise ValueError(f"norm must be one of {NORMS}; got {kind!r}")
