"""The position-wise feed-forward network: an MLP (ReLU, the paper's, or GELU) or a gated MLP
(SwiGLU). Projections are named as Hugging Face and torchtune name them."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .linear import Linear, shared_input

# The activation of each plain MLP kind, built once per layer by ``feed_forward``.
MLP_ACTIVATIONS = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,  # the exact erf form
    "gelu_tanh": functools.partial(nn.GELU, approximate="tanh"),  # GPT-2's approximation
}
ACTIVATIONS = (*MLP_ACTIVATIONS, "swiglu")


class MLP(nn.Module):
    """down_proj(dropout(activation(up_proj(x)))), for each position independently.

    x (..., d_model) -> (..., d_model)."""

    def __init__(self, d_model: int, d_ff: int, activation: nn.Module, dropout: float = 0.0,
                 bias: bool = True):
        super().__init__()
        self.up_proj = Linear(d_model, d_ff, bias=bias)
        self.down_proj = Linear(d_ff, d_model, bias=bias)
        self.activation = activation
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.dropout(self.activation(self.up_proj(x))))


class GatedMLP(nn.Module):
    """SwiGLU (Shazeer 2020): down_proj(dropout(silu(gate_proj(x)) * up_proj(x))).

    x (..., d_model) -> (..., d_model)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.gate_proj = Linear(d_model, d_ff, bias=bias)
        self.up_proj = Linear(d_model, d_ff, bias=bias)
        self.down_proj = Linear(d_ff, d_model, bias=bias)
        self.activation = nn.SiLU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = shared_input(x, (self.gate_proj, self.up_proj))  # one few-row call
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return self.down_proj(self.dropout(self.activation(gate) * up))
        # Without autograd nothing keeps the gate's values, so its buffer takes the product:
        # the same operations, two (N, d_ff) tensors fewer to allocate and fault in.
        return self.down_proj(self.dropout(F.silu(gate, inplace=True).mul_(up)))


def feed_forward(kind: str, d_model: int, d_ff: int, dropout: float = 0.0,
                 bias: bool = True) -> nn.Module:
    """The feed-forward layer ``kind`` names (one of ACTIVATIONS): "swiglu" is a GatedMLP,
    the others an MLP with that activation."""
    if kind == "swiglu":
        return GatedMLP(d_model, d_ff, dropout, bias)
    if kind not in MLP_ACTIVATIONS:
        raise ValueError(f"ffn must be one of {ACTIVATIONS}; got {kind!r}")
    return MLP(d_model, d_ff, MLP_ACTIVATIONS[kind](), dropout, bias)
