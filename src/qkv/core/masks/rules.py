"""The built-in mask rules (causal, sliding window, padding, segments, graph, a user's
FlexAttention-style ``mask_mod``), each with a fast ``tile_states`` where its structure
gives one, and the functions that make them."""

from __future__ import annotations

import torch
from torch import Tensor

from ..pointwise import pointwise
from ..structure import values_readable
from .base import Mask, as_4d, block_count, keyed_by_tensors, states_from, tile_bounds


class CausalMask(Mask):
    """Query i may see keys j <= i + (Nk - Nq): bottom-right aligned."""

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return kv_idx <= q_idx + offset

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        return window_states(None, 0, nk - nq, nq, nk, block_q, block_k, device)

    def layout_key(self):
        return (type(self),)

    def __repr__(self) -> str:
        return "causal()"


class TopLeftCausalMask(Mask):
    """Query i may see keys j <= i, whatever Nq and Nk: top-left aligned, as SDPA's and
    FlexAttention's ``is_causal``. It equals ``CausalMask`` when Nq == Nk."""

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return kv_idx <= q_idx

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        return window_states(None, 0, 0, nq, nk, block_q, block_k, device)

    def layout_key(self):
        return (type(self),)

    def __repr__(self) -> str:
        return "causal(align='top_left')"


def window_states(left: int | None, right: int, offset: int, nq: int, nk: int, block_q: int,
                  block_k: int, device) -> Tensor:
    """Tile states of "query i sees keys in [i + offset - left, i + offset + right]"."""
    q0, q1 = (t.view(-1, 1) + offset for t in tile_bounds(nq, block_q, device))
    k0, k1 = (t.view(1, -1) for t in tile_bounds(nk, block_k, device))
    full = k1 <= q0 + right
    empty = k0 > q1 + right
    if left is not None:
        full = full & (k0 >= q1 - left)
        empty = empty | (k1 < q0 - left)
    return as_4d(states_from(full, empty))


class SlidingWindowMask(Mask):
    """Query at key position p may see keys in [p - left, p + right]; left=None is unbounded."""

    def __init__(self, left: int | None, right: int = 0):
        for name, value in (("left", left), ("right", right)):
            if value is None and name == "left":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"sliding_window: {name} must be an int >= 0; got {value!r}")
        self.left, self.right = left, right

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        pos = q_idx + offset
        allowed = kv_idx <= pos + self.right
        if self.left is not None:
            allowed = allowed & (kv_idx >= pos - self.left)
        return allowed

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        return window_states(self.left, self.right, nk - nq, nq, nk, block_q, block_k, device)

    def layout_key(self):
        return (type(self), self.left, self.right)

    def __repr__(self) -> str:
        return f"sliding_window({self.left}, {self.right})"


class PaddingMask(Mask):
    """Batch element b may see keys j < lengths[b]."""

    def __init__(self, lengths):
        lengths = torch.as_tensor(lengths)
        if lengths.dim() != 1 or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
            raise ValueError(
                f"padding: lengths must be a 1-D integer tensor (B,); got dtype "
                f"{lengths.dtype} and shape {tuple(lengths.shape)}"
            )
        self.lengths = lengths.long()
        if values_readable():
            self._check_values(None)

    def tensors(self):
        return (self.lengths,)

    layout_key = keyed_by_tensors

    def check(self, batch, heads, nq, nk):
        if self.lengths.numel() != batch:
            raise ValueError(
                f"padding: lengths has {self.lengths.numel()} entries but the batch size is {batch}"
            )
        if values_readable():
            self._check_values(nk)

    def _check_values(self, nk: int | None) -> None:
        if (self.lengths < 0).any():
            raise ValueError("padding: lengths must be >= 0")
        if nk is not None and (self.lengths > nk).any():
            raise ValueError(
                f"padding: lengths must be <= Nk={nk}; got max {int(self.lengths.max())}"
            )

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return kv_idx < self.lengths.to(kv_idx.device)[b]

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        self.check(batch, heads, nq, nk)
        lengths = self.lengths.to(device).view(-1, 1, 1, 1)
        k0, k1 = (t.view(1, 1, 1, -1) for t in tile_bounds(nk, block_k, device))
        qb = block_count(nq, block_q)
        full = (k1 < lengths).expand(-1, -1, qb, -1)
        empty = (k0 >= lengths).expand(-1, -1, qb, -1)
        return states_from(full, empty)

    def __repr__(self) -> str:
        return f"padding({self.lengths.tolist()})"


def _ids_2d(ids, name: str) -> Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() not in (1, 2) or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(
            f"segments: {name} must be an integer tensor of shape (N,) or (B, N); got dtype "
            f"{ids.dtype} and shape {tuple(ids.shape)}"
        )
    return ids.long().unsqueeze(0) if ids.dim() == 1 else ids.long()


class SegmentMask(Mask):
    """Block-diagonal attention for packed documents: ids equal <=> may attend."""

    def __init__(self, q_ids, kv_ids=None):
        self.q_ids = _ids_2d(q_ids, "q_ids")
        self.kv_ids = self.q_ids if kv_ids is None else _ids_2d(kv_ids, "kv_ids")
        self.shared = kv_ids is None

    def tensors(self):
        return (self.q_ids, self.kv_ids)

    layout_key = keyed_by_tensors

    def check(self, batch, heads, nq, nk):
        for name, ids, n in (("q_ids", self.q_ids, nq), ("kv_ids", self.kv_ids, nk)):
            if ids.shape[0] not in (1, batch):
                raise ValueError(
                    f"segments: {name} has batch {ids.shape[0]}; expected 1 or {batch}"
                )
            if ids.shape[1] != n:
                hint = " (pass kv_ids when Nq != Nk)" if self.shared else ""
                raise ValueError(f"segments: {name} has length {ids.shape[1]}; expected {n}{hint}")

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        q_ids, kv_ids = self.q_ids.to(q_idx.device), self.kv_ids.to(kv_idx.device)
        qb = b if q_ids.shape[0] > 1 else 0
        kb = b if kv_ids.shape[0] > 1 else 0
        return q_ids[qb, q_idx] == kv_ids[kb, kv_idx]

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        self.check(batch, heads, nq, nk)

        def block_range(ids, block):
            n = ids.shape[1]
            nb = block_count(n, block)
            padded = torch.nn.functional.pad(ids.to(device), (0, nb * block - n), mode="replicate")
            blocks = padded.view(ids.shape[0], nb, block)
            return blocks.amin(-1), blocks.amax(-1)

        qmin, qmax = block_range(self.q_ids, block_q)
        kmin, kmax = block_range(self.kv_ids, block_k)
        qmin, qmax = qmin[:, :, None], qmax[:, :, None]
        kmin, kmax = kmin[:, None, :], kmax[:, None, :]
        empty = (qmax < kmin) | (kmax < qmin)
        full = (qmin == qmax) & (kmin == kmax) & (qmin == kmin)
        return states_from(full, empty).unsqueeze(1)

    def __repr__(self) -> str:
        return f"segments(q_ids of shape {tuple(self.q_ids.shape)})"


class GraphMask(Mask):
    """Attention along the edges of a directed graph.

    ``edges`` (2, E) integer rows (source, target): target may attend to source.
    ``adjacency`` (Nq, Nk) bool: adjacency[i, j] means node i may attend to node j.
    Both are stored as a sorted, de-duplicated edge list (target-major), which is also what a
    gather-based sparse engine reads.
    """

    def __init__(self, edges_or_adjacency, num_nodes: int | None = None):
        g = torch.as_tensor(edges_or_adjacency)
        if g.dtype == torch.bool:
            if g.dim() != 2:
                raise ValueError(
                    f"graph: adjacency must be 2-D (Nq, Nk); got shape {tuple(g.shape)}"
                )
            target, source = g.nonzero(as_tuple=True)
            self.shape: tuple[int, int] | None = (g.shape[0], g.shape[1])
        elif not g.dtype.is_floating_point and g.dim() == 2 and g.shape[0] == 2:
            source, target = g[0].long(), g[1].long()
            self.shape = (num_nodes, num_nodes) if num_nodes is not None else None
        else:
            raise ValueError(
                "graph: expected edges as an integer (2, E) tensor of (source, target) rows, or a "
                f"bool (N, N) adjacency; got dtype {g.dtype} and shape {tuple(g.shape)}"
            )
        if source.numel() and (min(int(source.min()), int(target.min())) < 0):
            raise ValueError("graph: edge indices must be >= 0")
        self.num_sources = int(source.max()) + 1 if source.numel() else 0
        self.num_targets = int(target.max()) + 1 if target.numel() else 0
        if self.shape is not None:
            self._check_range(*self.shape)
        # One integer key per edge; sorted so membership is a binary search.
        self._stride = max(1, self.num_sources)
        keys = torch.unique(target * self._stride + source)
        self.keys = keys
        self.target, self.source = keys // self._stride, keys % self._stride

    @property
    def num_edges(self) -> int:
        return self.keys.numel()

    def tensors(self):
        return (self.keys,)

    def _check_range(self, nq: int, nk: int) -> None:
        if self.num_targets > nq or self.num_sources > nk:
            raise ValueError(
                f"graph: edge index out of range: targets must be < Nq={nq} (max "
                f"{self.num_targets - 1}) and sources < Nk={nk} (max {self.num_sources - 1})"
            )

    def check(self, batch, heads, nq, nk):
        self._check_range(nq, nk)

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        keys = self.keys.to(q_idx.device)
        if keys.numel() == 0:
            return torch.zeros_like(q_idx + kv_idx, dtype=torch.bool)
        query = q_idx * self._stride + kv_idx
        pos = torch.searchsorted(keys, query).clamp(max=keys.numel() - 1)
        return (keys[pos] == query) & (kv_idx < self._stride)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        self.check(batch, heads, nq, nk)
        qb, kb = block_count(nq, block_q), block_count(nk, block_k)
        tile = (self.target // block_q) * kb + self.source // block_k
        counts = torch.bincount(tile, minlength=qb * kb).view(qb, kb).to(device)
        rows = torch.full((qb,), block_q, device=device)
        rows[-1] = nq - (qb - 1) * block_q
        cols = torch.full((kb,), block_k, device=device)
        cols[-1] = nk - (kb - 1) * block_k
        return as_4d(states_from(counts == rows[:, None] * cols[None, :], counts == 0))

    def __repr__(self) -> str:
        return f"graph({self.num_edges} edges)"


class CustomMask(Mask):
    """A user rule ``fn(b, h, q_idx, kv_idx) -> bool tensor`` (FlexAttention's mask_mod),
    evaluated with FlexAttention's semantics: once per score, on 0-d tensors (``pointwise``)."""

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"custom_mask: fn must be callable; got {type(fn).__name__}")
        self.fn = fn

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return pointwise(self.fn, b, h, q_idx, kv_idx).bool()

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        # Per-score evaluation fills every (b, h): chunks are counted with both.
        return super().tile_states(batch, heads, nq, nk, block_q, block_k, device,
                                   grid=batch * heads)


CAUSAL_ALIGNMENTS = ("bottom_right", "top_left")


def causal(align: str = "bottom_right") -> Mask:
    """Autoregressive mask. ``align="bottom_right"`` (the default, what a KV cache needs):
    query i sees keys j <= i + Nk - Nq, so the last query sees every key. ``"top_left"``
    (SDPA's and FlexAttention's ``is_causal``): query i sees keys j <= i. The two agree when
    Nq == Nk."""
    if align not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"causal: align must be one of {CAUSAL_ALIGNMENTS}; got {align!r}")
    return CausalMask() if align == "bottom_right" else TopLeftCausalMask()


def sliding_window(left: int, right: int = 0) -> Mask:
    """Local attention: a query at key position p sees keys p-left ... p+right."""
    return SlidingWindowMask(left, right)


def padding(lengths) -> Mask:
    """Key padding: batch element b sees keys j < lengths[b]. lengths: (B,) ints."""
    return PaddingMask(lengths)


def segments(q_ids, kv_ids=None) -> Mask:
    """Packed documents: query and key attend iff their segment ids are equal.
    Ids are (N,) or (B, N) integers; kv_ids defaults to q_ids."""
    return SegmentMask(q_ids, kv_ids)


def graph(edges_or_adjacency, num_nodes: int | None = None) -> Mask:
    """Graph attention: (2, E) (source, target) edges, target attends to source;
    or an (Nq, Nk) bool adjacency where [i, j] means i attends to j."""
    return GraphMask(edges_or_adjacency, num_nodes)


def custom_mask(fn) -> Mask:
    """Wrap a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool`` as a qkv mask."""
    return CustomMask(fn)
