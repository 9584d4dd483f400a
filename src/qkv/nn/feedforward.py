"""The position-wise feed-forward network: ReLU (the paper's), GELU, or SwiGLU."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")


class FeedForward(nn.Module):
    """FFN(x) = linear2(dropout(act(linear1(x)))), applied to each position independently.

    ``activation`` is "relu" (max(0, xW1 + b1)W2 + b2, the paper's), "gelu" (exact erf form),
    "gelu_tanh" (GPT-2's tanh approximation) or "swiglu" (linear2(silu(linear1 x) * gate x),
    Shazeer 2020). x: (..., d_model) -> (..., d_model).
    """

    def __init__(
        self, d_model: int, d_ff: int, activation: str = "relu", dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"ffn activation must be one of {ACTIVATIONS}; got {activation!r}")
        self.activation = activation
        self.linear1 = nn.Linear(d_model, d_ff, bias=bias)
        self.gate = nn.Linear(d_model, d_ff, bias=bias) if activation == "swiglu" else None
        self.linear2 = nn.Linear(d_ff, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.linear1(x)
        if self.activation == "relu":
            h = F.relu(h)
        elif self.activation == "gelu":
            h = F.gelu(h)
        elif self.activation == "gelu_tanh":
            h = F.gelu(h, approximate="tanh")
        else:
            h = F.silu(h) * self.gate(x)
        return self.linear2(self.dropout(h))
