"""Every rank of a context-parallel call must ask for the same thing: one small all_gather of
a descriptor first, so a disagreement (or a local error) is one clear error on every rank
instead of a hang in the ring."""

from __future__ import annotations

import re

import torch.distributed as dist
from torch import Tensor


def describe(obj) -> str:
    """A mask, score modifier or similarity as text that is equal on every rank asking for the
    same variant (object addresses removed; tensors by shape)."""
    if obj is None or isinstance(obj, (str, int, float)):
        return repr(obj)
    if isinstance(obj, Tensor):
        return f"tensor{tuple(obj.shape)}"
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", repr(obj))
    shapes = [tuple(t.shape) for t in getattr(obj, "tensors", tuple)()]
    return f"{text} reading {shapes}" if shapes else text


def agree(group, descriptor: dict, error: str | None) -> None:
    """Raise the same ValueError on every rank of ``group`` when any rank met ``error`` or the
    ranks' descriptors differ; return on every rank otherwise."""
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (descriptor, error), group=group)
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if errors:
        raise ValueError("context_parallel_attention: " + "; ".join(errors))
    first = gathered[0][0]
    for r, (desc, _) in enumerate(gathered):
        for key in first:
            if desc[key] != first[key]:
                hint = ""
                if key in ("q", "k", "v"):
                    hint = (" (every rank must hold an equal shard: the world size, times 2 for "
                            "the zigzag layout, must divide the sequence length)")
                raise ValueError(
                    f"context_parallel_attention: the ranks disagree on {key}: rank 0 has "
                    f"{first[key]}, rank {r} has {desc[key]}{hint}")
