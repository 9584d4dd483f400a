"""Which of the fused CPU engine's paths runs a call, and why: the one table.

The dispatcher (``engines.ENGINES``) first picks an engine per request: the flash C kernels
(``cpu_flash``: plain or causal dot-product inference), the graph engine (``graph_gather``:
sparse graph masks), then the fused engine. Within the fused engine, one call takes the first
path of ``PATHS`` whose refusal is None, forward and backward alike:

- ``BLOCKS``: whole query blocks in C, head by head, products by torch's BLAS
  (``native_blocks``). Refused (``native_blocks.why_not``) for a term without products or
  C loops, a tensor scale, a modifier whose gradient needs autograd, dropout, or gradients
  for tensors besides q, k and v.
- ``TILES``: tiles of all heads in Python; the softmax steps and a term's or modifier's
  loops in C. Refused without a C library for the dtype (no compiler, or QKV_NATIVE=0).
- ``TORCH_TILES``: the same tiles, every step in torch operations. Never refused.

The backward on tiles then composes its loop with the call's way to tile gradients
(``fused_backward.tile_grads``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

from torch import Tensor

from . import native, native_blocks
from .tiles import TileSpec


class CpuPath(enum.Enum):
    BLOCKS = "C query blocks"
    TILES = "Python tiles, C steps"
    TORCH_TILES = "Python tiles, torch steps"


def _no_c_library(spec: TileSpec, q: Tensor, extras: Sequence[Tensor]) -> str | None:
    if native.available(q.dtype):
        return None
    return f"no C library for {q.dtype} (no C compiler, or QKV_NATIVE=0)"


PATHS: tuple[tuple[CpuPath, Callable[..., str | None]], ...] = (
    (CpuPath.BLOCKS, native_blocks.why_not),
    (CpuPath.TILES, _no_c_library),
    (CpuPath.TORCH_TILES, lambda spec, q, extras: None),
)


def choose(spec: TileSpec, q: Tensor, extras: Sequence[Tensor] = ()
           ) -> tuple[CpuPath, list[tuple[CpuPath, str]]]:
    """The path that runs a call on features ``q`` (B, H, Nq, D) (with gradients for
    ``extras`` in the backward), and the refusals of the paths before it."""
    refused = []
    for path, why_not in PATHS:
        reason = why_not(spec, q, extras)
        if reason is None:
            return path, refused
        refused.append((path, reason))
    raise AssertionError("the last path runs every call")
