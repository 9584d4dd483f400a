"""``with context_parallel(group):`` models run on this rank's shard of each sequence.

Inside the block, ``qkv.nn.MultiHeadAttention`` sends its self-attention through
``context_parallel_attention`` and ``qkv.models.GPT`` gives its tokens their global positions,
so a model written for one process runs one sequence split across the group unchanged.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from .api import context_parallel_attention
from .layout import pieces_per_rank
from .layout import positions as layout_positions

# The open blocks, innermost last: a plain list, which torch.compile reads (a ContextVar it
# cannot trace).
_ACTIVE: list[ContextParallel] = []


@dataclass(frozen=True)
class ContextParallel:
    """The group a sequence is split over, its layout, and whether the attention itself sums
    the gradients of the tensors a variant reads (False where DDP over the same ranks does)."""

    group: dist.ProcessGroup | None
    layout: str = "contiguous"
    sum_extra_grads: bool = True

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def positions(self, n_local: int, device=None) -> Tensor:
        """(n_local,) the global positions of this rank's tokens."""
        return layout_positions(n_local * self.world, self.rank, self.world, self.layout, device)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
        return context_parallel_attention(q, k, v, group=self.group, layout=self.layout,
                                          sum_extra_grads=self.sum_extra_grads, **kwargs)


@contextlib.contextmanager
def context_parallel(group=None, layout: str = "contiguous", *, sum_extra_grads: bool = True):
    """Run models on sequence shards of ``layout`` over ``group`` inside this block."""
    pieces_per_rank(layout)  # an unknown layout fails here, not in the first attention call
    _ACTIVE.append(ContextParallel(group, layout, sum_extra_grads))
    try:
        yield _ACTIVE[-1]
    finally:
        _ACTIVE.pop()


def active() -> ContextParallel | None:
    """The ``context_parallel`` block this code runs in, or None."""
    return _ACTIVE[-1] if _ACTIVE else None
