"""Mask objects: which keys each query may attend to.

A mask is one small rule, ``mask_mod(b, h, q_idx, kv_idx, offset) -> bool``, evaluated on
broadcastable index tensors. ``offset = Nk - Nq`` aligns queries to the bottom right of the
score matrix, so query ``i`` sits at key position ``i + offset`` (what a KV cache needs).

Every engine derives from the same rule:
- the reference materializes it as a (B|1, H|1, Nq, Nk) bool tensor;
- the fused engines evaluate it per tile, and first ask ``tile_states`` which
  (query-block, key-block) tiles are EMPTY (skip), FULL (no masking) or PARTIAL.

Masks combine with ``&``, ``|`` and ``~``. ``tile_states`` is exact for EMPTY and FULL where it
says so; PARTIAL is always a safe answer.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .pointwise import pointwise
from .structure import Node, values_readable

EMPTY, PARTIAL, FULL = 0, 1, 2

# Evaluate at most this many mask entries at once when classifying tiles generically.
_CHUNK_ELEMENTS = 1 << 22


def index_grid(batch: int, heads: int, nq: int, nk: int, device) -> tuple[Tensor, ...]:
    """Index tensors shaped (B,1,1,1), (1,H,1,1), (1,1,Nq,1), (1,1,1,Nk)."""
    b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, -1, 1, 1)
    q = torch.arange(nq, device=device).view(1, 1, -1, 1)
    k = torch.arange(nk, device=device).view(1, 1, 1, -1)
    return b, h, q, k


def as_4d(t: Tensor) -> Tensor:
    """Leading size-1 dims up to 4-D: a rule's result broadcastable to (B, H, Nq, Nk)."""
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


def _blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


class Mask(Node):
    """Base class. Subclasses define ``mask_mod`` and may speed up ``tile_states``."""

    def mask_mod(self, b, h, q_idx, kv_idx, offset: int) -> Tensor:
        raise NotImplementedError

    def check(self, batch: int, heads: int, nq: int, nk: int) -> None:
        """Raise ValueError if the mask cannot apply to a (batch, heads, nq, nk) problem."""

    def tensors(self) -> tuple[Tensor, ...]:
        """Tensors the rule reads (moved along with the problem's device)."""
        return ()

    def layout_key(self) -> tuple | None:
        """A hashable key that, with the problem's shape, fixes ``tile_states``; None when the
        rule reads tensors or user code, which can change between calls."""
        return None

    def materialize(self, batch: int, heads: int, nq: int, nk: int, device=None) -> Tensor:
        """The mask as a bool tensor of shape (B|1, H|1, Nq, Nk); True = may attend."""
        self.check(batch, heads, nq, nk)
        b, h, q, k = index_grid(batch, heads, nq, nk, device)
        allowed = as_4d(torch.as_tensor(self.mask_mod(b, h, q, k, nk - nq), device=device))
        return allowed.expand(allowed.shape[0], allowed.shape[1], nq, nk)

    def tile_states(
        self, batch: int, heads: int, nq: int, nk: int, block_q: int, block_k: int, device=None,
        grid: int = 1,
    ) -> Tensor:
        """Classify tiles: uint8 (B|1, H|1, ceil(Nq/block_q), ceil(Nk/block_k)) of
        EMPTY / PARTIAL / FULL. This generic version evaluates the rule chunk by chunk, each
        of about _CHUNK_ELEMENTS entries per ``grid`` (batch, head) pairs it fills."""
        self.check(batch, heads, nq, nk)
        b, h, _, k = index_grid(batch, heads, nq, nk, device)
        kb = _blocks(nk, block_k)
        rows_per_chunk = max(1, _CHUNK_ELEMENTS // max(1, nk * block_q * grid)) * block_q
        chunks = []
        for q0 in range(0, nq, rows_per_chunk):
            q1 = min(nq, q0 + rows_per_chunk)
            q = torch.arange(q0, q1, device=device).view(1, 1, -1, 1)
            allowed = as_4d(torch.as_tensor(self.mask_mod(b, h, q, k, nk - nq), device=device))
            allowed = allowed.expand(allowed.shape[0], allowed.shape[1], q1 - q0, nk)
            chunks.append(_reduce_tiles(allowed, block_q, block_k, kb))
        return torch.cat(chunks, dim=2)

    def __and__(self, other) -> Mask:
        return AndMask(self, as_mask(other))

    def __rand__(self, other) -> Mask:
        return AndMask(as_mask(other), self)

    def __or__(self, other) -> Mask:
        return OrMask(self, as_mask(other))

    def __ror__(self, other) -> Mask:
        return OrMask(as_mask(other), self)

    def __invert__(self) -> Mask:
        return NotMask(self)


def _reduce_tiles(allowed: Tensor, block_q: int, block_k: int, kb: int) -> Tensor:
    """(B', H', rows, Nk) bool -> (B', H', ceil(rows/block_q), kb) tile states."""
    bsz, hsz, rows, nk = allowed.shape
    qb = _blocks(rows, block_q)
    pad = (0, kb * block_k - nk, 0, qb * block_q - rows)
    # Padding beyond the matrix must count as neither allowed (for "any") nor denied (for "all").
    any_ = torch.nn.functional.pad(allowed, pad, value=False)
    all_ = torch.nn.functional.pad(allowed, pad, value=True)
    shape = (bsz, hsz, qb, block_q, kb, block_k)
    has_any = any_.reshape(shape).any(dim=5).any(dim=3)
    has_all = all_.reshape(shape).all(dim=5).all(dim=3)
    return states_from(has_all, ~has_any)


def tile_bounds(n: int, block: int, device) -> tuple[Tensor, Tensor]:
    """First and last index of each block."""
    start = torch.arange(0, n, block, device=device)
    return start, torch.clamp(start + block - 1, max=n - 1)


def states_from(full: Tensor, empty: Tensor) -> Tensor:
    """Tile states (uint8) from bool tensors of FULL and EMPTY tiles; the rest PARTIAL."""
    # torch.where, not boolean indexing: on CUDA that waits for the GPU (a nonzero) every call.
    partial = torch.full((), PARTIAL, dtype=torch.uint8, device=full.device)
    states = torch.where(empty, torch.zeros_like(partial), partial)
    return torch.where(full, torch.full_like(partial, FULL), states)


class CausalMask(Mask):
    """Query i may see keys j <= i + (Nk - Nq): bottom-right aligned."""

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return kv_idx <= q_idx + offset

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        return SlidingWindowMask(None, 0).tile_states(
            batch, heads, nq, nk, block_q, block_k, device
        )

    def layout_key(self):
        return (type(self),)

    def __repr__(self) -> str:
        return "causal()"


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
        offset = nk - nq
        q0, q1 = (t.view(-1, 1) + offset for t in tile_bounds(nq, block_q, device))
        k0, k1 = (t.view(1, -1) for t in tile_bounds(nk, block_k, device))
        full = k1 <= q0 + self.right
        empty = k0 > q1 + self.right
        if self.left is not None:
            full = full & (k0 >= q1 - self.left)
            empty = empty | (k1 < q0 - self.left)
        return as_4d(states_from(full, empty))

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
        qb = _blocks(nq, block_q)
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
            nb = _blocks(n, block)
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
        qb, kb = _blocks(nq, block_q), _blocks(nk, block_k)
        tile = (self.target // block_q) * kb + self.source // block_k
        counts = torch.bincount(tile, minlength=qb * kb).view(qb, kb).to(device)
        rows = torch.full((qb,), block_q, device=device)
        rows[-1] = nq - (qb - 1) * block_q
        cols = torch.full((kb,), block_k, device=device)
        cols[-1] = nk - (kb - 1) * block_k
        return as_4d(states_from(counts == rows[:, None] * cols[None, :], counts == 0))

    def __repr__(self) -> str:
        return f"graph({self.num_edges} edges)"


class TensorMask(Mask):
    """A bool tensor broadcastable to (B, H, Nq, Nk); True = may attend."""

    def __init__(self, allowed: Tensor):
        if not isinstance(allowed, Tensor):
            raise TypeError(
                f"mask must be a bool tensor or a qkv mask; got {type(allowed).__name__}"
            )
        if allowed.dtype != torch.bool:
            raise TypeError(
                f"mask must be a bool tensor (True = may attend); got dtype {allowed.dtype}. "
                "For an additive float bias use score_mod."
            )
        if allowed.dim() > 4:
            raise ValueError(f"mask must have at most 4 dims (B, H, Nq, Nk); got {allowed.dim()}")
        self.given_shape = tuple(allowed.shape)
        self.allowed = as_4d(allowed)

    def tensors(self):
        return (self.allowed,)

    def check(self, batch, heads, nq, nk):
        target = (batch, heads, nq, nk)
        if any(s not in (1, t) for s, t in zip(self.allowed.shape, target, strict=True)):
            raise ValueError(
                f"mask of shape {self.given_shape} does not broadcast to (B, H, Nq, Nk) = {target}"
            )

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        a = self.allowed.to(q_idx.device)
        idx = [i if a.shape[d] > 1 else 0 for d, i in enumerate((b, h, q_idx, kv_idx))]
        return a[idx[0], idx[1], idx[2], idx[3]]

    def materialize(self, batch, heads, nq, nk, device=None):
        self.check(batch, heads, nq, nk)
        a = self.allowed.to(device)
        return a.expand(a.shape[0], a.shape[1], nq, nk)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        allowed = self.materialize(batch, heads, nq, nk, device)
        return _reduce_tiles(allowed, block_q, block_k, _blocks(nk, block_k))


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


class AndMask(Mask):
    def __init__(self, a: Mask, b: Mask):
        self.a, self.b = a, b

    def check(self, *shape):
        self.a.check(*shape)
        self.b.check(*shape)

    def tensors(self):
        return self.a.tensors() + self.b.tensors()

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return self.a.mask_mod(b, h, q_idx, kv_idx, offset) & self.b.mask_mod(
            b, h, q_idx, kv_idx, offset
        )

    def layout_key(self):
        a, b = self.a.layout_key(), self.b.layout_key()
        return None if a is None or b is None else (type(self), a, b)

    def tile_states(self, *args, **kwargs):
        # EMPTY < PARTIAL < FULL: a tile is as open as its more closed side.
        return torch.minimum(
            self.a.tile_states(*args, **kwargs), self.b.tile_states(*args, **kwargs)
        )

    def __repr__(self) -> str:
        return f"({self.a!r} & {self.b!r})"


class OrMask(AndMask):
    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return self.a.mask_mod(b, h, q_idx, kv_idx, offset) | self.b.mask_mod(
            b, h, q_idx, kv_idx, offset
        )

    def tile_states(self, *args, **kwargs):
        return torch.maximum(
            self.a.tile_states(*args, **kwargs), self.b.tile_states(*args, **kwargs)
        )

    def __repr__(self) -> str:
        return f"({self.a!r} | {self.b!r})"


class NotMask(Mask):
    def __init__(self, inner: Mask):
        self.inner = inner

    def check(self, *shape):
        self.inner.check(*shape)

    def tensors(self):
        return self.inner.tensors()

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return ~self.inner.mask_mod(b, h, q_idx, kv_idx, offset)

    def tile_states(self, *args, **kwargs):
        return FULL - self.inner.tile_states(*args, **kwargs)

    def layout_key(self):
        inner = self.inner.layout_key()
        return None if inner is None else (type(self), inner)

    def __repr__(self) -> str:
        return f"~{self.inner!r}"


def as_mask(mask) -> Mask | None:
    """None, a bool tensor or a Mask -> Mask (or None)."""
    if mask is None or isinstance(mask, Mask):
        return mask
    if isinstance(mask, Tensor):
        return TensorMask(mask)
    raise TypeError(
        f"mask must be None, a bool tensor or a qkv mask object; got {type(mask).__name__}"
    )


def causal() -> Mask:
    """Autoregressive mask, bottom-right aligned when Nq != Nk (query i sees j <= i + Nk - Nq)."""
    return CausalMask()


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
