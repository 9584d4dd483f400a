"""Positional information: added to embeddings, rotated into q and k, or added to scores.

Each scheme is its own module with the same three questions answered:
- ``embed(positions)``: what to add to the token embeddings (sinusoidal, learned), or None;
- ``score_mod()``: the score modifier every attention layer adds (ALiBi, T5's relative bias),
  or None;
- ``rotary()``: the RotaryEmbedding every self-attention layer applies to q and k (RoPE), or
  None.
``make_positions`` builds one from a ``PositionsConfig``. Positions are integer tensors (N,)
or (B, N); under a KV cache they continue from the cache length, and with left padding they
start at each row's first real token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..core import ScoreMod, alibi, relative_bias
from ..core.scores import alibi_slopes
from ..engines.cpu import row_ops
from ..limits import check_limits, limited

POSITION_KINDS = ("sinusoidal", "learned", "rope", "alibi", "relative", "none")


@dataclass
class PositionsConfig:
    """How a model encodes positions: ``kind`` (one of POSITION_KINDS); ``rope_base`` is
    RoPE's frequency base."""

    kind: str = limited("learned", choices=POSITION_KINDS)
    rope_base: float = limited(10000.0, "(0, inf)")

    def __post_init__(self):
        check_limits(self, "PositionsConfig")


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


class Rotation(NamedTuple):
    """RoPE's rotation at some positions, computed once for a whole stack of layers:
    ``cos`` (..., N, D) holds cos θ for both halves, ``sin`` (..., N, D) holds (-sin θ, sin θ),
    so that rotating x is x · cos + swap_halves(x) · sin."""

    cos: Tensor
    sin: Tensor


def last_positions(positions: Tensor | Rotation, n: int) -> Tensor | Rotation:
    """The last ``n`` of positions (..., N) or of their Rotation: where the queries of a
    self-attention call sit when they are the last n of its keys."""
    if isinstance(positions, Rotation):
        return Rotation(positions.cos[..., -n:, :], positions.sin[..., -n:, :])
    return positions[..., -n:]


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

    def rotation(self, positions: Tensor) -> Rotation:
        """positions (N,) or (B, N) -> their Rotation, (N, D) or (B, 1, N, D) float32."""
        angles = positions.to(self.inv_freq.dtype).unsqueeze(-1) * self.inv_freq  # (.., N, D/2)
        if angles.dim() == 3:  # (B, N, D/2) -> (B, 1, N, D/2): the same positions for all heads
            angles = angles.unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        return Rotation(torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1))

    def forward(self, x: Tensor, positions: Tensor | Rotation) -> Tensor:
        """x (B, H, N, D), positions (N,) or (B, N), or their ``rotation`` -> x rotated, same
        shape and dtype."""
        rotation = positions if isinstance(positions, Rotation) else self.rotation(positions)
        # Decoding's few positions in one C call, not nine operations (qkv.engines.cpu.row_ops).
        rotated = row_ops.rotate(x, rotation.cos, rotation.sin)
        if rotated is not None:
            return rotated
        xf = x.float()
        half = xf.shape[-1] // 2
        out = xf * rotation.cos
        # + swap_halves(x) · sin, half by half: the same sums without a swapped copy of x
        out[..., :half].addcmul_(xf[..., half:], rotation.sin[..., :half])
        out[..., half:].addcmul_(xf[..., :half], rotation.sin[..., half:])
        return out.to(x.dtype)


class PositionScheme(nn.Module):
    """What every scheme answers (see the module docstring); this base adds nothing."""

    max_len: int | None = None  # the longest sequence it encodes; None: unbounded

    def check_length(self, length: int) -> None:
        if self.max_len is not None and length > self.max_len:
            raise ValueError(
                f"sequence of {length} positions is longer than the learned position table "
                f"(max_len={self.max_len})"
            )

    def embed(self, positions: Tensor) -> Tensor | None:
        """What to add to the token embeddings at ``positions`` (..., N): (..., N, d_model)."""
        return None

    def score_mod(self) -> ScoreMod | None:
        """The score modifier every attention layer of the stack adds, or None."""
        return None

    def rotary(self) -> RotaryEmbedding | None:
        """The rotation every self-attention layer of the stack applies to q and k, or None."""
        return None

    def for_layers(self, positions: Tensor) -> Tensor | Rotation:
        """What the stack's layers receive as ``positions``: the positions, or for RoPE their
        rotation, computed here once instead of in every layer."""
        return positions


class NoPositions(PositionScheme):
    """No positional information ("none")."""


class SinusoidalPositions(PositionScheme):
    """The paper's fixed encoding, added to the embeddings."""

    def __init__(self, d_model: int):
        super().__init__()
        self.d_model = d_model

    def embed(self, positions: Tensor) -> Tensor:
        return sinusoidal_encoding(positions, self.d_model)


class LearnedPositions(PositionScheme):
    """A learned table of ``max_len`` position vectors (GPT-2's wpe), added to the embeddings."""

    def __init__(self, max_len: int, d_model: int):
        super().__init__()
        self.max_len = max_len
        self.table = nn.Embedding(max_len, d_model)

    def embed(self, positions: Tensor) -> Tensor:
        return self.table(positions)


class RotaryPositions(PositionScheme):
    """RoPE: q and k rotated in every self-attention layer (shared by the stack)."""

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        self.rope = RotaryEmbedding(head_dim, base)

    def rotary(self) -> RotaryEmbedding:
        return self.rope

    def for_layers(self, positions: Tensor) -> Rotation:
        return self.rope.rotation(positions)


class ALiBiPositions(PositionScheme):
    """ALiBi (Press et al., 2022): a per-head linear penalty on distance, added to scores."""

    def __init__(self, n_head: int):
        super().__init__()
        self.register_buffer("slopes", alibi_slopes(n_head), persistent=False)

    def score_mod(self) -> ScoreMod:
        return alibi(slopes=self.slopes)


class RelativePositions(PositionScheme):
    """T5's learned relative bias: one value per (distance bucket, head), added to scores.
    ``bidirectional``: buckets for keys on both sides (encoder) or only the past (causal)."""

    def __init__(self, n_head: int, bidirectional: bool = True, num_buckets: int = 32,
                 max_distance: int = 128):
        super().__init__()
        self.bias_table = nn.Parameter(0.02 * torch.randn(num_buckets, n_head))
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.bidirectional = bidirectional

    def score_mod(self) -> ScoreMod:
        return relative_bias(self.bias_table, self.num_buckets, self.max_distance,
                             self.bidirectional)


def make_positions(config: PositionsConfig, *, d_model: int, n_head: int, head_dim: int,
                   max_len: int, bidirectional: bool = True) -> PositionScheme:
    """The scheme ``config.kind`` names, for a stack of width ``d_model`` with ``n_head``
    heads of ``head_dim``; ``max_len`` sizes a learned table, ``bidirectional`` a relative
    bias."""
    builders = {
        "sinusoidal": lambda: SinusoidalPositions(d_model),
        "learned": lambda: LearnedPositions(max_len, d_model),
        "rope": lambda: RotaryPositions(head_dim, config.rope_base),
        "alibi": lambda: ALiBiPositions(n_head),
        "relative": lambda: RelativePositions(n_head, bidirectional),
        "none": NoPositions,
    }
    if config.kind not in builders:
        raise ValueError(f"positions must be one of {POSITION_KINDS}; got {config.kind!r}")
    return builders[config.kind]()
