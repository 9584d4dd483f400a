"""Pieces the four models share: initialization, token checks, positions and padding."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-2 / BERT initialization: N(0, std) weights for linear and embedding layers, zero
    biases; norms keep their ones and zeros."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, std)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)


def token_positions(offset: int, n: int, left_pad: Tensor | None, device) -> Tensor:
    """Absolute positions of n new tokens after ``offset`` cached ones: (n,), or (B, n) when
    rows are left-padded by ``left_pad`` (B,) tokens (a row's first real token is position 0)."""
    positions = torch.arange(offset, offset + n, device=device)
    if left_pad is None:
        return positions
    return (positions.unsqueeze(0) - left_pad.to(device).unsqueeze(1)).clamp(min=0)


def check_ids(name: str, ids, vocab_size: int | None = None) -> None:
    """Token ids must be an integer tensor (B, N); with ``vocab_size``, of at least one token,
    each in [0, vocab_size) (an embedding lookup would fail with a bare "index out of range").
    The values are not read while torch.compile or torch.export traces."""
    if not isinstance(ids, Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point or (
        ids.dtype == torch.bool
    ):
        got = f"shape {tuple(ids.shape)}, {ids.dtype}" if isinstance(ids, Tensor) else type(ids)
        raise ValueError(f"{name} must be an integer tensor of token ids (B, N); got {got}")
    if vocab_size is None:
        return
    if ids.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one token per row; got shape "
                         f"{tuple(ids.shape)}")
    if ids.numel() and not torch.compiler.is_compiling():
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name}: token ids must lie in [0, {vocab_size}) (the "
                             f"vocabulary); got {bad}")


def check_lengths(name: str, lengths: Tensor | None, batch: int, n: int) -> Tensor | None:
    if lengths is None:
        return None
    lengths = torch.as_tensor(lengths)
    if lengths.shape != (batch,) or lengths.dtype.is_floating_point:
        raise ValueError(
            f"{name} must be an integer tensor of shape (B,)=({batch},); got "
            f"{tuple(lengths.shape)} {lengths.dtype}"
        )
    if bool((lengths < 1).any()) or bool((lengths > n).any()):
        raise ValueError(f"{name} must lie in [1, {n}] (the padded length); got "
                         f"{lengths.tolist()}")
    return lengths.long()


def key_mask(keep: Tensor) -> Tensor | None:
    """keep (B, N) bool, True for real tokens -> a key mask (B, 1, 1, N), or None when every
    token is real, so that the fastest engine (SDPA) may run. While torch.compile or
    torch.export traces, the mask is always returned: a graph cannot branch on its values."""
    if not torch.compiler.is_compiling() and bool(keep.all()):
        return None
    return keep[:, None, None, :]


def left_align(ids: Tensor, lengths: Tensor, pad_id: int) -> tuple[Tensor, Tensor]:
    """Right-padded ids (B, N) with lengths (B,) -> left-padded ids and left_pad (B,), so that
    every row's last real token sits in the last column."""
    n = ids.shape[1]
    left_pad = n - lengths.to(ids.device)
    source = torch.arange(n, device=ids.device).unsqueeze(0) - left_pad.unsqueeze(1)
    aligned = ids.gather(1, source.clamp(min=0))
    return aligned.masked_fill(source < 0, pad_id), left_pad


def place_after(ids: Tensor, lengths: Tensor, new: Tensor, pad_id: int) -> Tensor:
    """Right-padded prompts ids (B, N) and continuations new (B, T) -> (B, N + T), each row
    its prompt then its continuation, padded with pad_id."""
    b, n = ids.shape
    out = ids.new_full((b, n + new.shape[1]), pad_id)
    keep = torch.arange(n, device=ids.device).unsqueeze(0) < lengths.unsqueeze(1)
    out[:, :n] = ids.masked_fill(~keep, pad_id)
    where = lengths.unsqueeze(1) + torch.arange(new.shape[1], device=ids.device)
    return out.scatter(1, where, new)
