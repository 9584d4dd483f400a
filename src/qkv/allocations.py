"""Large allocations returned to the system when freed: for the commands that compute maps a
block of rows at a time, and for sharded training, which gathers and frees each unit's
weights while it keeps small gradient shards."""

from __future__ import annotations

import ctypes
import functools

# glibc's mallopt parameter: allocations of at least this many bytes are mapped pages.
_M_MMAP_THRESHOLD = -3


@functools.cache
def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own mapped
    pages, returned to the system when freed. glibc otherwise raises its threshold to 32 MB
    after the first large free and carves large blocks from the heap, where small tensors
    kept between them pin the freed space:
    - maps computed a block of rows at a time keep per-row summaries and compact rows
      between the blocks: SmolLM2 at 8,192 tokens grew by 270-540 MB a layer, and by under
      10 MB with the threshold fixed (docs/viz.md, "Long texts");
    - a sharded training step gathers and frees each unit's weights and gradients while the
      gradient shards it keeps (1 to 2 MB each for SmolLM2) accumulate until the optimizer
      step: SmolLM2's ranks peak about 0.9 GB lower with the threshold fixed, for some more
      CPU time a step in page faults (docs/distributed.md, "Memory").
    Once per process; elsewhere than glibc this does nothing."""
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own C library
    except (OSError, TypeError):  # Windows has no CDLL(None)
        return
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, threshold)
