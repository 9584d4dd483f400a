"""Per-row and per-key summaries of every captured head, in memory linear in the sequence.

A map at 8k tokens is 64 M weights per head: SmolLM2's 30 layers x 9 heads would take 69 GB
in float32. ``Summarizer`` is a ``capture(on_weights=...)`` callback that reads the weights
a block of query rows at a time (``capture``'s ``row_bytes``), keeps per head

- the entropy of each row (bits),
- the mean attention distance of each row (tokens between the query's position and the key),
- the mass each row puts on the first token (an attention sink),
- the mass each key receives, summed over the rows (which tokens get attention),
- each row's ``top_k`` keys and their weights,

and lets the block go. Calls that follow (generated tokens through a KV cache) append their
rows; the keys they add extend the per-key sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .capture import CapturedMap, ObservedCall, capture
from .scene import map_large_allocations

TOP_K = 8


@dataclass
class HeadStats:
    """One layer's summaries over its captured heads h (batch row 0).

    entropy, distance, sink: (h, Nq) per query row; received: (h, Nk) summed over the rows;
    top_keys (h, Nq, top_k) int64 and top_weights (h, Nq, top_k) float32: each row's largest
    weights in descending order; where a row attends fewer than top_k keys, the rest are
    key -1 with weight 0."""

    heads: list[int]
    entropy: Tensor
    distance: Tensor
    sink: Tensor
    received: Tensor
    top_keys: Tensor
    top_weights: Tensor


@dataclass
class _Rows:
    heads: list[int]
    parts: dict[str, list[Tensor]] = field(default_factory=lambda: {
        "entropy": [], "distance": [], "sink": [], "top_keys": [], "top_weights": []})
    received: Tensor | None = None

    def receive(self, column_sums: Tensor) -> None:
        """Add (h, Nk) column sums; a call with more keys extends the sums with zeros."""
        if self.received is None:
            self.received = column_sums
            return
        grow = column_sums.shape[1] - self.received.shape[1]
        if grow > 0:
            self.received = torch.nn.functional.pad(self.received, (0, grow))
        self.received[:, :column_sums.shape[1]] += column_sums

    def stats(self, top_k: int) -> HeadStats:
        def rows(name):
            parts = self.parts[name]
            if name.startswith("top_"):  # early rows may have had fewer than top_k keys
                parts = [torch.nn.functional.pad(p, (0, top_k - p.shape[-1]),
                                                 value=-1 if name == "top_keys" else 0.0)
                         for p in parts]
            return torch.cat(parts, dim=1)

        return HeadStats(self.heads, rows("entropy"), rows("distance"), rows("sink"),
                         self.received, rows("top_keys"), rows("top_weights"))


class Summarizer:
    """The ``on_weights`` callback of the module docstring; ``stats()`` gives every captured
    layer's ``HeadStats`` by the layer's module path."""

    def __init__(self, top_k: int = TOP_K):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int; got {top_k!r}")
        self.top_k = top_k
        self.sites: dict[str, _Rows] = {}

    def __call__(self, site: CapturedMap, weights: Tensor, call: ObservedCall) -> None:
        w = weights[0].float()  # (h, rows, Nk)
        nk = w.shape[-1]
        # Query i of the call sits at key position i + Nk - Nq (bottom-right, as the masks).
        first = call.first_row + nk - call.q.shape[2]
        positions = torch.arange(first, first + w.shape[1], device=w.device)
        keys = torch.arange(nk, device=w.device)
        gap = (positions[:, None] - keys[None, :]).abs().to(w.dtype)
        rows = self.sites.setdefault(site.name, _Rows(list(site.heads)))
        top = w.topk(min(self.top_k, nk), dim=-1)
        top_keys = torch.where(top.values > 0, top.indices, -1)
        for name, value in (("entropy", -torch.special.xlogy(w, w).sum(-1) / math.log(2)),
                            ("distance", (w * gap).sum(-1)),
                            # A copy: a view would keep the whole block alive.
                            ("sink", w[..., 0].clone()),
                            ("top_keys", top_keys), ("top_weights", top.values)):
            rows.parts[name].append(value)
        rows.receive(w.sum(1))

    def stats(self) -> dict[str, HeadStats]:
        return {name: rows.stats(self.top_k) for name, rows in self.sites.items()}


def summarize(model: torch.nn.Module, forward, *, layers=None, heads=None, top_k: int = TOP_K,
              row_bytes: int = 64 << 20) -> dict[str, HeadStats]:
    """Run ``forward()`` (a call of ``model``) under ``capture`` and return each captured
    layer's ``HeadStats``; at most ``row_bytes`` of float32 weights exist at once."""
    map_large_allocations()
    summarizer = Summarizer(top_k)
    with capture(model, layers=layers, heads=heads, on_weights=summarizer,
                 row_bytes=row_bytes), torch.no_grad():
        forward()
    return summarizer.stats()
