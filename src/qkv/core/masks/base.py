"""The mask type: a rule ``mask_mod(b, h, q_idx, kv_idx, offset) -> bool``, its tile states
(EMPTY, PARTIAL, FULL) and its algebra (``&``, ``|``, ``~``), with the one mask that is
data rather than a rule: a bool tensor. The built-in rules are in ``rules``."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from ..structure import Node

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


def broadcast_index(t: Tensor, b, h, q_idx, kv_idx):
    """``t[b, h, q_idx, kv_idx]`` for a 4-D ``t`` broadcastable to (B, H, Nq, Nk): a dimension
    of size 1 is read at 0 whatever its index."""
    idx = [i if t.shape[d] > 1 else 0 for d, i in enumerate((b, h, q_idx, kv_idx))]
    return t[idx[0], idx[1], idx[2], idx[3]]


def block_count(n: int, block: int) -> int:
    return (n + block - 1) // block


class TensorKey:
    """A tensor a mask reads, as part of a layout key: equal while the tensor it views is the
    same living object and the view has the same memory, shape, strides, dtype and version.
    The version counts in-place writes through any view; writes through ``.data`` or NumPy
    are not counted, so a mask over a tensor written that way is built anew. The key holds a
    weak reference: a kept layout never keeps the user's tensor alive, and a tensor made
    later at the same address is another object, so it never matches."""

    __slots__ = ("_source", "_identity")

    def __init__(self, tensor: Tensor):
        # a mask keeps a view of the user's tensor (segments ids get a batch dim): the
        # user's tensor is the view's base, the same object from one mask to the next
        self._source = weakref.ref(tensor if tensor._base is None else tensor._base)
        self._identity = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype,
                          tensor.device, tensor._version)

    def __eq__(self, other) -> bool:
        if not isinstance(other, TensorKey) or self._identity != other._identity:
            return False
        source = self._source()
        return source is not None and source is other._source()

    def __hash__(self) -> int:
        return hash(self._identity)


def keyed_by_tensors(mask: Mask) -> tuple | None:
    """``layout_key`` for a rule fixed by its class and the tensors it reads (``tensors()``);
    None where a tensor cannot be followed: a tensor subclass (a fake tensor while tracing, a
    functional tensor), a meta tensor, or an inference tensor (which keeps no version)."""
    tensors = mask.tensors()
    if any(type(t) is not Tensor or t.device.type == "meta" or t.is_inference()
           for t in tensors):
        return None
    return (type(mask), *(TensorKey(t) for t in tensors))


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
        rule reads user code, or tensors it does not key (segments and padding key theirs:
        ``keyed_by_tensors``)."""
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
        kb = block_count(nk, block_k)
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
    qb = block_count(rows, block_q)
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
                "An additive float mask goes to qkv.attention as attn_mask= or mask=."
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
        return broadcast_index(self.allowed.to(q_idx.device), b, h, q_idx, kv_idx)

    def materialize(self, batch, heads, nq, nk, device=None):
        self.check(batch, heads, nq, nk)
        a = self.allowed.to(device)
        return a.expand(a.shape[0], a.shape[1], nq, nk)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        allowed = self.materialize(batch, heads, nq, nk, device)
        return _reduce_tiles(allowed, block_q, block_k, block_count(nk, block_k))


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
