"""Positional information: added to embeddings, rotated into q and k, or added to scores.

``Positions(kind, ...)`` bundles one scheme for a model:
- "sinusoidal" (the paper's fixed encoding) and "learned" (a table) are added to embeddings;
- "rope" rotates q and k inside every self-attention layer (``Positions.rope``);
- "alibi" and "relative" (T5 bias) are score modifiers (``Positions.score_mod()``);
- "none" adds nothing.
Positions are integer tensors (N,) or (B, N); under a KV cache they continue from the cache
length, and with left padding they start at each row's first real token.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..core import ScoreMod, alibi, relative_bias
from ..core.scores import alibi_slopes

POSITION_KINDS = ("sinusoidal", "learned", "rope", "alibi", "relative", "none")


def sinusoidal_encoding(positions: Tensor, d_model: int) -> Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d)).

    positions: integer (...,) -> (..., d_model) float32."""
    if d_model % 2:
        raise ValueError(f"sinusoidal positions need an even d_model; got {d_model}")
    i = torch.arange(0, d_model, 2, dtype=torch.float64, device=positions.device)
    inv_freq = torch.exp(-math.log(10000.0) * i / d_model)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    pe = torch.stack((angles.sin(), angles.cos()), dim=-1).flatten(-2)
    return pe.to(torch.float32)


class LearnedPositions(nn.Module):
    """A learned table of ``max_len`` position vectors (GPT-2's wpe)."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)

    def forward(self, positions: Tensor) -> Tensor:
        return self.table(positions)


class RotaryEmbedding(nn.Module):
    """RoPE (Su et al., 2021): rotates pairs (x[i], x[i + D/2]) by angle pos · base^(-2i/D).

    A rotation keeps norms, and <rot(q, m), rot(k, n)> depends only on m - n, so relative
    position enters the dot product without any table (and without a length limit)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rope needs an even head dim; got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x (B, H, N, D), positions (N,) or (B, N) -> x rotated, same shape and dtype."""
        angles = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # (.., N, D/2)
        if angles.dim() == 3:  # (B, N, D/2) -> (B, 1, N, D/2): the same positions for all heads
            angles = angles.unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return rotated.to(x.dtype)


class Positions(nn.Module):
    """One positional scheme for one stack of layers (see the module docstring).

    Args:
        kind: one of POSITION_KINDS.
        d_model: embedding width (for "sinusoidal" and "learned").
        n_head: heads (for "alibi" slopes and the "relative" bias table).
        head_dim: per-head width (for "rope").
        max_len: size of the "learned" table; the other kinds have no length limit.
        bidirectional: for "relative": buckets for keys on both sides (encoder) or only the
            past (causal decoder).
    """

    def __init__(
        self, kind: str, *, d_model: int, n_head: int, head_dim: int, max_len: int,
        bidirectional: bool = True, rope_base: float = 10000.0, num_buckets: int = 32,
        max_distance: int = 128,
    ):
        super().__init__()
        if kind not in POSITION_KINDS:
            raise ValueError(f"positions must be one of {POSITION_KINDS}; got {kind!r}")
        self.kind, self.d_model = kind, d_model
        self.learned = LearnedPositions(max_len, d_model) if kind == "learned" else None
        self.rope = RotaryEmbedding(head_dim, rope_base) if kind == "rope" else None
        if kind == "alibi":
            self.register_buffer("slopes", alibi_slopes(n_head), persistent=False)
        if kind == "relative":
            self.bias_table = nn.Parameter(0.02 * torch.randn(num_buckets, n_head))
            self.bucket_args = (num_buckets, max_distance, bidirectional)

    @property
    def max_len(self) -> int | None:
        """The longest sequence this scheme can encode, or None when unbounded."""
        return self.learned.max_len if self.learned is not None else None

    def check_length(self, length: int) -> None:
        if self.max_len is not None and length > self.max_len:
            raise ValueError(
                f"sequence of {length} positions is longer than the learned position table "
                f"(max_len={self.max_len})"
            )

    def embed(self, positions: Tensor) -> Tensor | None:
        """What to add to the token embeddings at ``positions`` (..., N): (..., N, d_model)."""
        if self.kind == "sinusoidal":
            return sinusoidal_encoding(positions, self.d_model)
        if self.learned is not None:
            return self.learned(positions)
        return None

    def score_mod(self) -> ScoreMod | None:
        """The score modifier every attention layer of the stack adds, or None."""
        if self.kind == "alibi":
            return alibi(slopes=self.slopes)
        if self.kind == "relative":
            num_buckets, max_distance, bidirectional = self.bucket_args
            return relative_bias(self.bias_table, num_buckets, max_distance, bidirectional)
        return None
