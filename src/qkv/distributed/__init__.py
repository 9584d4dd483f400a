"""Context parallelism: one long sequence split across processes, for every attention variant.

``context_parallel_attention`` runs ring attention over torch.distributed; ``shard``,
``unshard`` and ``positions`` say which positions each rank holds in either layout; inside
``with context_parallel(group):`` qkv's modules and GPT run on sequence shards.
``vocab`` splits a token embedding and LM head by vocabulary rows over a process group.
This package builds on ``qkv.attention`` only (never on ``qkv.train``).
"""

from .api import context_parallel_attention
from .context import ContextParallel, active, context_parallel
from .layout import LAYOUTS, positions, shard, unshard

__all__ = ["LAYOUTS", "ContextParallel", "active", "context_parallel",
           "context_parallel_attention", "positions", "shard", "unshard"]
