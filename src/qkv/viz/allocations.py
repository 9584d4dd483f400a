"""Large allocations returned to the system when freed, for the commands that compute maps a
block of rows at a time."""

from __future__ import annotations

import ctypes
import functools

# glibc's mallopt parameter: allocations of at least this many bytes are mapped pages.
_M_MMAP_THRESHOLD = -3


@functools.cache
def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own mapped
    pages, returned to the system when freed. Maps are computed a block of rows at a time:
    glibc otherwise raises its threshold to 32 MB after the first large free, carves the
    blocks from the heap, and the small tensors kept between them (per-row summaries, compact
    rows) pin the freed space: SmolLM2 at 8,192 tokens grew by 270-540 MB a layer, and by
    under 10 MB with the threshold fixed (docs/viz.md, "Long texts"). Once per process;
    elsewhere than glibc this does nothing."""
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own C library
    except (OSError, TypeError):  # Windows has no CDLL(None)
        return
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, threshold)
