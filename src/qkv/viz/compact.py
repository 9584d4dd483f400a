"""Attention maps stored compactly, one layer's heads at a time, and per-head summaries.

A page of SmolLM2 at 2,048 tokens has 30 layers x 9 heads of 2,048 x 2,048 weights: 4.5 GB in
float32. ``HeadRows`` keeps, per query row, only the keys whose weight reaches a threshold
(at most ``max_per_row`` of them, the largest), each as one byte (weight ~ byte / 255), and
records the attention mass each row leaves out. ``RowsBuilder.add`` takes one forward call's
(H, Nq, Nk) weights and turns them into rows at once, so capture never holds more than one
layer's float32 maps.

``HeadSummary`` is computed from the full float32 rows before anything is dropped: entropy,
mean attended distance, the share on the first token (the "sink") and on the previous token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

LEVELS = 255  # one byte per stored weight: weight ~ byte / LEVELS
SUMMARY_COLUMNS = ("entropy", "distance", "sink", "previous")


@dataclass
class HeadRows:
    """One head's stored weights over Nq query rows.

    counts (Nq,): keys stored per row; cols (nnz,): their key indices, ascending within a row;
    values (nnz,) uint8: weight ~ value / 255; dropped (Nq,): attention mass not stored."""

    counts: np.ndarray
    cols: np.ndarray
    values: np.ndarray
    dropped: np.ndarray

    def dense(self, nk: int) -> np.ndarray:
        """The stored weights as a (Nq, nk) float32 matrix (left-out entries are 0)."""
        out = np.zeros((len(self.counts), nk), np.float32)
        rows = np.repeat(np.arange(len(self.counts)), self.counts)
        out[rows, self.cols] = self.values / LEVELS
        return out


@dataclass
class HeadSummary:
    """Sums over query rows, per head: entropy (bits), attended distance (tokens), weight on
    key 0, weight on key (position - 1); ``rows`` rows with any allowed key, ``rows_with_prev``
    of them have a previous token."""

    sums: np.ndarray  # (H, 4) in SUMMARY_COLUMNS order
    rows: np.ndarray  # (H,)
    rows_with_prev: np.ndarray  # (H,)

    def means(self) -> np.ndarray:
        """(H, 4) per-row means (0 for a head with no rows)."""
        per = np.stack([self.rows, self.rows, self.rows, self.rows_with_prev], axis=1)
        return np.where(per > 0, self.sums / np.maximum(per, 1), 0.0)


def _summary(w: Tensor, row_sums: Tensor, distance: Tensor, positions: Tensor):
    """w (Nq, Nk) float rows of one head, their sums (Nq,), distance (Nq, Nk) |position - key|
    and positions (Nq,) each query's position among the keys -> (sums (4,), rows, rows with a
    previous token)."""
    live = row_sums > 0
    # A differential head's map holds negative weights too: the entropy is of its positive
    # ones, the weights the page draws (softmax rows are unchanged).
    positive = w.clamp_min(0)
    entropy = -torch.special.xlogy(positive, positive).sum(-1) / math.log(2)
    attended = (w * distance).sum(-1)
    sink = w[:, 0]
    has_prev = (positions >= 1) & (positions - 1 < w.shape[1]) & live
    prev_index = (positions - 1).clamp(0, w.shape[1] - 1)
    prev = torch.where(has_prev, w.gather(1, prev_index[:, None])[:, 0], 0.0)
    sums = [float(x[live].sum()) for x in (entropy, attended, sink)] + [float(prev.sum())]
    return np.array(sums), int(live.sum()), int(has_prev.sum())


def compress_head(w: Tensor, threshold: float, max_per_row: int | None,
                  row_sums: Tensor | None = None) -> HeadRows:
    """w (Nq, Nk) float rows -> HeadRows: entries >= threshold, the largest max_per_row."""
    keep = w >= threshold
    if max_per_row is not None and max_per_row < w.shape[1]:
        kth = w.topk(max_per_row, dim=-1).values[:, -1:]
        keep &= w >= kth
    rows, cols = keep.nonzero(as_tuple=True)
    kept = w[rows, cols]
    values = torch.round(kept * LEVELS).clamp(1, LEVELS).to(torch.uint8)
    row_sums = w.sum(-1) if row_sums is None else row_sums
    kept_sums = torch.zeros_like(row_sums).index_add_(0, rows, kept)
    dropped = (row_sums - kept_sums).clamp_min(0)
    counts = torch.bincount(rows, minlength=w.shape[0])
    return HeadRows(counts.cpu().numpy().astype(np.int32), cols.cpu().numpy().astype(np.int32),
                    values.cpu().numpy(), dropped.float().cpu().numpy())


@dataclass
class RowsBuilder:
    """Collects one attention layer's heads row by row, call after call (a prompt, then one
    row per generated token), keeping only compact rows and summary sums."""

    heads: int
    threshold: float
    max_per_row: int | None
    parts: list[list[HeadRows]] = field(default_factory=list)
    summary: HeadSummary | None = None

    def add(self, weights: Tensor, first_position: int) -> None:
        """weights (H, Nq, Nk) of one call; query row i sits at key position first_position+i."""
        if weights.dim() != 3 or weights.shape[0] != self.heads:
            raise ValueError(f"weights must be ({self.heads}, Nq, Nk); got {tuple(weights.shape)}")
        w = weights.detach().float()
        positions = torch.arange(w.shape[1], device=w.device) + first_position
        keys = torch.arange(w.shape[2], device=w.device)
        distance = (positions[:, None] - keys[None, :]).abs().float()  # shared by the heads
        part, sums, rows, prev = [], [], [], []
        for h in range(self.heads):
            row_sums = w[h].sum(-1)
            part.append(compress_head(w[h], self.threshold, self.max_per_row, row_sums))
            s, r, p = _summary(w[h], row_sums, distance, positions)
            sums.append(s)
            rows.append(r)
            prev.append(p)
        self.parts.append(part)
        add = HeadSummary(np.stack(sums), np.array(rows), np.array(prev))
        if self.summary is not None:
            add = HeadSummary(add.sums + self.summary.sums, add.rows + self.summary.rows,
                              add.rows_with_prev + self.summary.rows_with_prev)
        self.summary = add

    def rows(self) -> list[HeadRows]:
        """Every call's rows joined, one HeadRows per head."""
        if not self.parts:
            raise ValueError("no attention rows were recorded")
        return join_rows(self.parts)


def cap_rows(rows: HeadRows, k: int) -> tuple[HeadRows, np.ndarray]:
    """``rows`` keeping at most the ``k`` largest stored weights per row (ties: the earlier
    key), and which entries were kept (nnz,) bool; what is removed joins each row's dropped
    mass."""
    row_of = np.repeat(np.arange(len(rows.counts)), rows.counts)
    order = np.lexsort((rows.cols, -rows.values.astype(np.int32), row_of))  # by row, largest
    starts = np.concatenate([[0], np.cumsum(rows.counts)[:-1]])
    rank = np.empty(len(order), np.int64)
    rank[order] = np.arange(len(order)) - np.repeat(starts, rows.counts)
    keep = rank < k
    removed = np.bincount(row_of[~keep], rows.values[~keep] / LEVELS, len(rows.counts))
    return HeadRows(np.minimum(rows.counts, k).astype(np.int32), rows.cols[keep],
                    rows.values[keep], (rows.dropped + removed).astype(np.float32)), keep


def join_rows(parts: list[list[HeadRows]]) -> list[HeadRows]:
    """Consecutive parts (each one HeadRows per head, for consecutive query rows) as one
    HeadRows per head."""
    return [HeadRows(*(np.concatenate([getattr(p[h], name) for p in parts])
                       for name in ("counts", "cols", "values", "dropped")))
            for h in range(len(parts[0]))]


def compress_dense(weights: Tensor, threshold: float,
                   max_per_row: int | None = None) -> tuple[list[list[HeadRows]], np.ndarray]:
    """weights (L, H, Nq, Nk) -> rows [layer][head] and summary means (L, H, 4); self-attention
    rows are at positions 0..Nq-1 (bottom-right aligned when Nq < Nk)."""
    rows, means = [], []
    for layer in weights:
        builder = RowsBuilder(layer.shape[0], threshold, max_per_row)
        builder.add(layer, layer.shape[2] - layer.shape[1])
        rows.append(builder.rows())
        means.append(builder.summary.means())
    return rows, np.stack(means)
