"""What a page holds at a long input: the per-row summaries of every layer and head, and the
maps of the chosen layers and heads only.

At 8,192 tokens SmolLM2's 270 heads would need about 80 MB of stored weights at the page's
threshold, over three times its budget, and their float32 weights 69 GB. ``LongRecorder`` is
a ``capture.watch`` callback: a ``Summarizer`` computes every head's summaries from the
engine's log-sum-exp a block of rows at a time, and the same blocks of the chosen heads
become compact rows (``compact.compress_head``), so each weight is computed once. The page
view it gives says what it leaves out (``PageView.omitted``).
"""

from __future__ import annotations

import threading

import numpy as np
from torch import Tensor

from .capture import CapturedMap
from .compact import HeadRows, compress_head
from .page import PageView
from .summaries import HeadStats, Summarizer


def _spans(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    spans, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            spans.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(spans)


def head_means(stats: HeadStats, first_position: int) -> np.ndarray:
    """(h, 4) per-row means of entropy, distance, sink and previous-token mass (the page's
    head summary); the previous token's mean is over the rows that have one."""
    has_previous = (np.arange(stats.entropy.shape[1]) + first_position) >= 1
    means = [t.double().mean(1).numpy() for t in (stats.entropy, stats.distance, stats.sink)]
    previous = stats.previous.double().numpy()[:, has_previous]
    means.append(previous.mean(1) if previous.shape[1] else np.zeros(len(stats.heads)))
    return np.stack(means, axis=1)


class LongRecorder:
    """The ``watch`` callback of the module docstring.

    threshold, max_per_row: what the chosen heads' rows keep (``compact.compress_head``);
    layers, heads: the chosen layer and head indices (None: all)."""

    def __init__(self, threshold: float, max_per_row: int | None, layers=None, heads=None):
        self.threshold, self.max_per_row = threshold, max_per_row
        self.layers = None if layers is None else set(layers)
        self.heads = None if heads is None else set(heads)
        self.summarizer = Summarizer(top_k=1, on_block=self._keep)
        self.calls: dict[str, int] = {}
        # (layer path, head) -> [((call, first row), rows)]; blocks come from worker threads.
        self.parts: dict[tuple[str, int], list[tuple[tuple[int, int], HeadRows]]] = {}
        self.lock = threading.Lock()

    def mapped(self, site: CapturedMap, head: int) -> bool:
        return (self.layers is None or site.layer in self.layers) and \
            (self.heads is None or head in self.heads)

    def __call__(self, site: CapturedMap, q: Tensor, k: Tensor, kwargs: dict, lse) -> None:
        self.calls[site.name] = self.calls.get(site.name, -1) + 1
        self.summarizer(site, q, k, kwargs, lse)

    def _keep(self, site: CapturedMap, heads: list[int], w: Tensor, first: int) -> None:
        call = self.calls[site.name]
        for i, head in enumerate(heads):
            if self.mapped(site, head):
                rows = compress_head(w[i], self.threshold, self.max_per_row)
                with self.lock:
                    self.parts.setdefault((site.name, head), []).append(((call, first), rows))

    def _rows(self, name: str, head: int) -> HeadRows:
        parts = [rows for _, rows in sorted(self.parts[(name, head)], key=lambda p: p[0])]
        return HeadRows(*(np.concatenate([getattr(p, field) for p in parts])
                          for field in ("counts", "cols", "values", "dropped")))

    def view(self, sites: list[CapturedMap], name: str, query_tokens: list[str],
             key_tokens: list[str], *, first_generated: int | None = None) -> PageView:
        """The page view of one self-attention stack's layers: every head's summaries, the
        chosen heads' maps (None elsewhere), and what the page leaves out."""
        stats = self.summarizer.stats()
        heads = list(sites[0].heads)
        rows = [[self._rows(s.name, h) if self.mapped(s, h) else None for h in heads]
                for s in sites]
        first_position = len(key_tokens) - len(query_tokens)
        summary = np.stack([head_means(stats[s.name], first_position) for s in sites])
        return PageView(name, "self", query_tokens, key_tokens, [s.layer for s in sites],
                        heads, rows=rows, summary=summary,
                        row_stats=[stats[s.name] for s in sites],
                        first_generated=first_generated, omitted=self._omitted(sites, rows))

    def _omitted(self, sites: list[CapturedMap], rows) -> list[str]:
        layers = [s.layer for s, layer in zip(sites, rows, strict=True)
                  if any(r is not None for r in layer)]
        heads = sorted({h for layer in rows for h, r in zip(sites[0].heads, layer, strict=True)
                        if r is not None})
        total, kept = len(sites) * len(sites[0].heads), sum(
            r is not None for layer in rows for r in layer)
        shown = f"layers {_spans(layers)} x heads {_spans(heads)}" if kept else "no head"
        return [f"At this length the page holds the per-row summaries of all {len(sites)} "
                f"layers x {len(sites[0].heads)} heads and the maps of {shown} ({kept} of "
                f"{total} heads).",
                f"Left out: the maps of the other {total - kept} heads (qkv viz --layers and "
                "--heads choose the mapped ones; qkv viz --serve shows any head); each row's "
                "top keys outside the maps; the neuron view."]
