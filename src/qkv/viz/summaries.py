"""Per-row and per-key summaries of every head, in memory linear in the sequence.

A map at 8k tokens is 64 M weights per head: SmolLM2's 30 layers x 9 heads would take 69 GB
in float32. ``Summarizer`` is a ``capture.watch`` callback that reads each layer's q, k and
the engine's log-sum-exp, computes the weights a block of query rows at a time, keeps per
head

- the entropy of each row (bits),
- the mean attention distance of each row (tokens between the query's position and the key),
- the mass each row puts on the first token (an attention sink) and on the previous token,
- the mass each key receives, summed over the rows (which tokens get attention),
- each row's ``top_k`` keys and their weights,

and lets the block go. Calls that follow (generated tokens through a KV cache) append their
rows; the keys they add extend the per-key sums.

Dot-product attention under a causal mask (or none) takes the fast path: per block, one
matrix multiply for the scores of the keys the rows may see (a causal block skips the keys
after its last row: half the work at full length), then ``row_stats``' C loop, on torch's
thread count of workers. Other calls (a score modifier, another mask or similarity, no C
compiler) get their weights from ``head_weights`` and the same summaries from torch
operations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..allocations import map_large_allocations
from ..core.masks.rules import CausalMask, TopLeftCausalMask
from ..core.weighting import as_weighting
from ..engines.cpu.workers import run_queued
from .capture import CapturedMap, watch
from .row_stats import library, row_stats
from .weights import check_heads, head_weights

TOP_K = 8
# Scores computed at once per worker: 3 heads x 42 rows x 8,192 keys; the block stays in the
# last-level cache between the matrix multiply and the C loop.
ROW_BYTES = 4 << 20
# The keywords of a call the fast path computes exactly (with the values _fast_call checks).
_FAST_KEYWORDS = {"mask", "score_mod", "similarity", "scale", "metric", "return_weights",
                  "dropout_p", "fp32_precision", "weighting"}
_COLUMNS = ("entropy", "distance", "sink", "previous", "top_keys", "top_weights", "mass")

# on_block(site, heads, weights, first_row): heads (a sorted list of head indices), weights
# (len(heads), R, n) float32 of query rows first_row.. against keys 0..n-1 (0 where masked;
# keys past n get none). Called from worker threads; the tensor is reused after it returns.
OnBlock = Callable[[CapturedMap, list[int], Tensor, int], None]


@dataclass
class HeadStats:
    """One layer's summaries over its summarized heads h (batch row 0).

    entropy, distance, sink, previous: (h, Nq) per query row; received: (h, Nk) summed over
    the rows; top_keys (h, Nq, top_k) int64 and top_weights (h, Nq, top_k) float32: each
    row's largest weights in descending order; where a row attends fewer than top_k keys,
    the rest are key -1 with weight 0; mass (h, Nq): each row's sum of weights, 1 under
    softmax, anything under a weighting that does not normalize."""

    heads: list[int]
    entropy: Tensor
    distance: Tensor
    sink: Tensor
    previous: Tensor
    received: Tensor
    top_keys: Tensor
    top_weights: Tensor
    mass: Tensor


@dataclass
class _Rows:
    heads: list[int]
    parts: dict[str, list[Tensor]] = field(
        default_factory=lambda: {name: [] for name in _COLUMNS})
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

    def stats(self) -> HeadStats:
        rows = {name: torch.cat(parts, dim=1) for name, parts in self.parts.items()}
        return HeadStats(self.heads, **rows, received=self.received)


def _scale(kwargs: dict, head_dim: int) -> float | None:
    scale = kwargs.get("scale")
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) \
        else None


def _causal(kwargs: dict, nq: int, nk: int) -> bool | None:
    """True for a causal mask, False for none, None for any other mask."""
    mask = kwargs.get("mask")
    if mask is None:
        return False
    if type(mask) is CausalMask or (type(mask) is TopLeftCausalMask and nq == nk):
        return True
    return None


def fast_path(q: Tensor, k: Tensor, kwargs: dict) -> bool:
    """Whether ``row_stats`` computes this call's summaries exactly: dot-product scores with
    one scale, no score modifier, a causal mask or none, float weights on the CPU, and the C
    loop built."""
    return (set(kwargs) <= _FAST_KEYWORDS and kwargs.get("score_mod") is None
            and as_weighting(kwargs.get("weighting", "softmax")).is_softmax
            and kwargs.get("metric") is None and kwargs.get("similarity", "dot") == "dot"
            and _scale(kwargs, q.shape[-1]) is not None
            and _causal(kwargs, q.shape[2], k.shape[2]) is not None
            and q.device.type == "cpu" and q.is_floating_point() and library() is not None)


def _blocks(groups: list[tuple[int, int, int]], nq: int, offset: int, causal: bool, nk: int,
            row_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """Work items (group, first head, last head + 1, row start, row stop) of about
    ``row_bytes`` of scores each; a causal block's keys end at its last row's position."""
    def seen(stop: int) -> int:  # keys the rows before ``stop`` see (at least one)
        return max(1, min(nk, stop + offset) if causal else nk)

    items = []
    for g, a, b in groups:
        start = 0
        while start < nq:
            rows = max(1, row_bytes // (4 * (b - a) * seen(start + 1)))
            rows = max(1, min(rows, row_bytes // (4 * (b - a) * seen(start + rows))))
            stop = min(nq, start + rows)
            items.append((g, a, b, start, stop))
            start = stop
    return items


def _fast_call(q: Tensor, k: Tensor, lse: Tensor | None, kwargs: dict, heads: list[int],
               top_k: int, row_bytes: int, on_block) -> dict[str, Tensor]:
    """Summaries of one call by ``row_stats``: {column: (h, Nq...)} and "received" (h, Nk)."""
    nq, nk, n_head = q.shape[2], k.shape[2], q.shape[1]
    causal, scale = _causal(kwargs, nq, nk), _scale(kwargs, q.shape[-1])
    offset = nk - nq  # query i sits at key position i + offset (bottom-right)
    group = n_head // k.shape[1]
    keys = k[0].float()
    # Runs of the chosen heads that share a key head: positions a..b-1 in ``heads``.
    groups, a = [], 0
    for b in range(1, len(heads) + 1):
        if b == len(heads) or heads[b] // group != heads[a] // group:
            groups.append((heads[a] // group, a, b))
            a = b
    items = _blocks(groups, nq, offset, causal, nk, row_bytes)
    index = torch.tensor(heads)
    stats = torch.empty(len(heads), nq, 4)
    top = (torch.empty(len(heads), nq, top_k, dtype=torch.int64),
           torch.empty(len(heads), nq, top_k))

    def task(indices) -> Tensor:
        received, scratch = torch.zeros(len(heads), nk), torch.empty(0)
        for i in indices:
            g, a, b, start, stop = items[i]
            n = max(0, min(nk, stop + offset)) if causal else nk
            size = (b - a) * (stop - start) * n
            if scratch.numel() < size:
                scratch = torch.empty(size)
            s = scratch[:size].view(b - a, stop - start, n)
            chosen = index[a:b]
            rows = q[0, :, start:stop].index_select(0, chosen).float() * scale
            torch.matmul(rows, keys[g, :n].T, out=s)
            shift = None if lse is None else \
                lse[0, :, start:stop].index_select(0, chosen).float().contiguous()
            block, top_keys, top_values = row_stats(s, shift, start + offset, causal,
                                                    received[a:b], top_k)
            stats[a:b, start:stop] = block
            top[0][a:b, start:stop], top[1][a:b, start:stop] = top_keys, top_values
            if on_block is not None:
                on_block(heads[a:b], s, start)
        return received

    sums = run_queued(task, items, lambda item: (item[2] - item[1]) * (item[4] - item[3])
                      * (min(nk, item[4] + offset) if causal else nk))
    columns = dict(zip(_COLUMNS[:4], stats.unbind(-1), strict=True))
    # Softmax rows with a key (a causal mask or none leaves every row one) sum to 1.
    return {**columns, "top_keys": top[0], "top_weights": top[1], "received": sum(sums),
            "mass": torch.ones(len(heads), nq)}


def _torch_call(q: Tensor, k: Tensor, lse: Tensor | None, kwargs: dict, heads: list[int],
                top_k: int, row_bytes: int, on_block) -> dict[str, Tensor]:
    """The same summaries for any call, from ``head_weights`` a block of rows at a time."""
    nq, nk = q.shape[2], k.shape[2]
    block = max(1, row_bytes // (4 * len(heads) * nk))
    parts: dict[str, list[Tensor]] = {name: [] for name in _COLUMNS}
    received = torch.zeros(len(heads), nk)
    keys = torch.arange(nk)
    metric = kwargs.get("metric")
    for start in range(0, nq, block):
        stop = min(nq, start + block)
        w = head_weights(q, k, heads, mask=kwargs.get("mask"),
                         score_mod=kwargs.get("score_mod"),
                         similarity=kwargs.get("similarity", "dot"), scale=kwargs.get("scale"),
                         metric=None if metric is None else metric.detach(), lse=lse,
                         rows=(start, stop), weighting=kwargs.get("weighting", "softmax")
                         )[0].float()  # (h, rows, Nk)
        positions = torch.arange(start, stop) + nk - nq
        gap = (positions[:, None] - keys[None, :]).abs().float()
        previous = (positions - 1).clamp(0, nk - 1)
        prev = w.gather(2, previous.view(1, -1, 1).expand(len(heads), -1, 1))[..., 0]
        top = w.topk(min(top_k, nk), dim=-1)
        pad = top_k - top.values.shape[-1]
        values = torch.nn.functional.pad(top.values, (0, pad))
        top_keys = torch.nn.functional.pad(torch.where(top.values > 0, top.indices, -1),
                                           (0, pad), value=-1)
        for name, value in (("entropy", -torch.special.xlogy(w, w).sum(-1) / math.log(2)),
                            ("distance", (w * gap).sum(-1)), ("sink", w[..., 0].clone()),
                            ("previous", torch.where(positions >= 1, prev, 0.0)),
                            ("top_keys", top_keys), ("top_weights", values),
                            ("mass", w.sum(-1))):
            parts[name].append(value)
        received += w.sum(1)
        if on_block is not None:
            on_block(heads, w, start)
    return {**{name: torch.cat(p, dim=1) for name, p in parts.items()}, "received": received}


class Summarizer:
    """The ``watch`` callback of the module docstring: ``stats()`` gives every watched
    layer's ``HeadStats`` by the layer's module path.

    heads: the query heads to summarize (None: all); row_bytes: the scores a worker holds at
    once; on_block: also hand each block's weights to ``on_block(site, heads, weights,
    first_row)`` (``OnBlock``), e.g. to keep some heads' maps."""

    def __init__(self, top_k: int = TOP_K, *, heads=None, row_bytes: int = ROW_BYTES,
                 on_block: OnBlock | None = None):
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be a positive int; got {top_k!r}")
        self.top_k, self.heads, self.row_bytes = top_k, heads, row_bytes
        self.on_block = on_block
        self.sites: dict[str, _Rows] = {}

    def __call__(self, site: CapturedMap, q: Tensor, k: Tensor, kwargs: dict,
                 lse: Tensor | None) -> None:
        heads = check_heads(self.heads, q.shape[1], site.name)
        compute = _fast_call if fast_path(q, k, kwargs) else _torch_call
        on_block = None if self.on_block is None else \
            lambda chosen, w, first: self.on_block(site, chosen, w, first)
        with torch.no_grad():
            found = compute(q, k, lse, kwargs, heads, self.top_k, self.row_bytes, on_block)
        rows = self.sites.setdefault(site.name, _Rows(heads))
        for name in _COLUMNS:
            rows.parts[name].append(found[name])
        rows.receive(found["received"])

    def stats(self) -> dict[str, HeadStats]:
        return {name: rows.stats() for name, rows in self.sites.items()}


def summarize(model: torch.nn.Module, forward, *, layers=None, heads=None, top_k: int = TOP_K,
              row_bytes: int = ROW_BYTES) -> dict[str, HeadStats]:
    """Run ``forward()`` (a call of ``model``) with its layers watched and return each
    watched layer's ``HeadStats``; each worker holds at most about ``row_bytes`` of scores."""
    map_large_allocations()
    summarizer = Summarizer(top_k, heads=heads, row_bytes=row_bytes)
    with watch(model, summarizer, layers=layers), torch.no_grad():
        forward()
    return summarizer.stats()
