"""transformers' mask functions as qkv masks that keep their structure.

transformers describes a layer's mask as a FlexAttention-style ``mask_function(b, h, q, kv)``
over absolute positions, composed from a few factories in ``transformers.masking_utils``
(causal, bidirectional, sliding-window and chunked overlays, packed sequences, padding), plus
a 2-D padding mask. ``mask_function`` below reads that composition (the factories' closures)
and builds the same rule from qkv's masks: ``causal() & ~padding(starts)`` for a left-padded
batch, ``sliding_window(w - 1)``, ``segments(ids)``. The fused engines then skip empty tiles
and never see a dense (B, 1, Nq, Nk) tensor.

A piece it does not recognize (a model's own ``or_mask_function``, say) is kept as what it is,
``qkv.custom_mask`` of that function at absolute positions: exact, evaluated one score at a
time (slower), and still combined with the recognized pieces, whose tiles stay skippable.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor
from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
from torch.nn.attention.flex_attention import BlockMask
from transformers import masking_utils as hf

from ...core import masks as qm

# Hints transformers passes every mask function for its own backends; none changes the rule.
_HINTS = {"allow_is_causal_skip", "allow_is_bidirectional_skip", "allow_torch_fix", "local_size",
          "dtype", "config", "use_vmap", "device"}


class Unmasked(qm.Mask):
    """Every key allowed. Returned instead of None so that the attention function knows the
    mask was built (a bidirectional layer), rather than falling back to ``module.is_causal``."""

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return torch.ones((), dtype=torch.bool, device=q_idx.device)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None, grid=1):
        shape = (1, 1, -(-nq // block_q), -(-nk // block_k))
        return torch.full(shape, qm.FULL, dtype=torch.uint8, device=device)

    def __repr__(self) -> str:
        return "unmasked()"


class Prepared(BlockMask):
    """A qkv mask in the type transformers passes through as already prepared: a mask built
    ahead of the forward (static-cache generation builds it in ``prepare_inputs_for_generation``)
    comes back into the model's own mask creation, which keeps a ``BlockMask`` (or a 4-D
    tensor) of shape (B, 1, Nq, Nk) as it is. Only the attention function reads ``mask``;
    ``packed`` says that it already keeps packed documents apart (transformers found them in
    the position ids it was given)."""

    def __init__(self, mask: qm.Mask, shape: tuple[int, int, int, int], packed: bool = False):
        self.mask, self._shape, self.packed = mask, shape, packed

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def __repr__(self) -> str:
        return f"prepared({self.mask!r}, shape={self._shape})"

    __str__ = __repr__


class Shifted(qm.Mask):
    """``inner`` with query i at key position i + shift instead of i + Nk - Nq: a cache whose
    keys do not end at the last query (transformers' static cache: q_offset - kv_offset)."""

    def __init__(self, inner: qm.Mask, shift: int):
        self.inner, self.shift = inner, shift

    def check(self, *shape):
        self.inner.check(*shape)

    def tensors(self):
        return self.inner.tensors()

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return self.inner.mask_mod(b, h, q_idx, kv_idx, self.shift)

    def __repr__(self) -> str:
        return f"shifted({self.inner!r}, {self.shift})"


class KeyMask(qm.Mask):
    """keep (B, Nk) bool: batch element b may see key j iff keep[b, j]. For padding that is
    not one contiguous run per row (contiguous runs become ``qkv.padding`` pieces)."""

    def __init__(self, keep: Tensor):
        self.keep = keep

    def tensors(self):
        return (self.keep,)

    def check(self, batch, heads, nq, nk):
        if tuple(self.keep.shape) != (batch, nk):
            raise ValueError(f"key mask has shape {tuple(self.keep.shape)}; expected {(batch, nk)}")

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return self.keep.to(kv_idx.device)[b, kv_idx]

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None, grid=1):
        self.check(batch, heads, nq, nk)
        kb = -(-nk // block_k)
        keep = self.keep.to(device)
        blocks = [keep[:, j * block_k:(j + 1) * block_k] for j in range(kb)]
        full = torch.stack([blk.all(1) for blk in blocks], 1)
        empty = ~torch.stack([blk.any(1) for blk in blocks], 1)
        states = qm.states_from(full, empty).view(batch, 1, 1, kb)
        return states.expand(batch, 1, -(-nq // block_q), kb)

    def __repr__(self) -> str:
        return f"keys(shape {tuple(self.keep.shape)})"


def keys_mask(keep: Tensor) -> qm.Mask | None:
    """(B, Nk) bool keys to keep -> a qkv mask, or None when every key is kept. One run of kept
    keys per row (left or right padding) becomes ``~padding(starts) & padding(ends)``."""
    keep = keep.bool()
    if torch.compiler.is_compiling():
        # The runs below are read from the values, which branching on would break the graph;
        # the per-key mask is exact for any padding.
        return KeyMask(keep)
    if bool(keep.all()):
        return None
    nk = keep.shape[1]
    positions = torch.arange(nk, device=keep.device)
    starts = keep.long().argmax(1)
    ends = starts + keep.sum(1)
    if not torch.equal(keep, (positions >= starts[:, None]) & (positions < ends[:, None])):
        return KeyMask(keep)
    parts = []
    if bool((starts > 0).any()):
        parts.append(~qm.padding(starts))
    if bool((ends < nk).any()):
        parts.append(qm.padding(ends))
    return functools.reduce(lambda a, b: a & b, parts)


def position_segments(position_ids: Tensor | None, batch: int, nq: int,
                      nk: int) -> qm.Mask | None:
    """Documents packed in one row, told apart only by position ids that restart, as
    flash-attention's varlen path reads them: ``segments`` of the runs. For a model that does
    not hand its position ids to transformers' mask creation (GPT-OSS), whose masks then span
    the whole row. None where the shapes rule a packed row out (a batch, a cache, a single
    query, position ids of another shape) or, outside tracing, the row is one document
    (transformers' own test, ``find_packed_sequence_indices``)."""
    if (position_ids is None or batch != 1 or nq != nk or nq == 1
            or tuple(position_ids.shape) != (1, nq)):
        return None
    ids = hf.find_packed_sequence_indices(position_ids)
    return None if ids is None else qm.segments(ids)

class _Absolute:
    """A transformers mask function called at absolute positions, per score (for custom_mask).
    Indexing a tensor with the 0-d indices needs transformers' own vmap helper."""

    def __init__(self, fn, q_offset: int, kv_offset: int):
        self.fn, self.q_offset, self.kv_offset = fn, q_offset, kv_offset

    def __call__(self, b, h, q_idx, kv_idx):
        with TransformGetItemToIndex():
            return self.fn(b, h, q_idx + self.q_offset, kv_idx + self.kv_offset)


def _cells(fn) -> dict:
    code = fn.__code__
    return dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ()),
                    strict=True))


def _code_of(factory: str, *args):
    """The code object of the closures a masking_utils factory returns; None if transformers
    no longer has that factory (its pieces then fall back to custom_mask)."""
    make = getattr(hf, factory, None)
    return make(*args).__code__ if make is not None else None


def _handler(fn):
    """The handler of a masking_utils function, found by its code object. A search by
    identity rather than a dict lookup: torch.compile traces the one, not the other."""
    code = getattr(fn, "__code__", None)
    for known, handler in _HANDLERS:
        if code is known:
            return handler
    return None


class _Context:
    """Sizes and offsets of one mask request; ``translate`` maps a mask function to a qkv mask
    (None = every key allowed)."""

    def __init__(self, batch: int, nq: int, nk: int, q_offset: int, kv_offset: int):
        self.batch, self.nq, self.nk = batch, nq, nk
        self.q_offset, self.kv_offset = q_offset, kv_offset
        self.saw_packed = False  # whether the composition holds packed documents' ids

    def rows(self, ids: Tensor, offset: int, n: int) -> Tensor:
        """Per-position ids (B, L) over absolute positions -> this request's (B, n) window."""
        return ids.expand(self.batch, -1)[:, offset:offset + n]

    def translate(self, fn):
        handler = _handler(fn)
        if handler is None:
            return qm.custom_mask(_Absolute(fn, self.q_offset, self.kv_offset))
        return handler(self, _cells(fn))

    def causal(self, cells):
        return qm.causal()

    def bidirectional(self, cells):
        return None

    def both(self, cells):
        parts = [self.translate(f) for f in cells["mask_functions"]]
        parts = [p for p in parts if p is not None]
        windows = [p for p in parts if isinstance(p, qm.SlidingWindowMask)]
        if windows and any(isinstance(p, qm.CausalMask) for p in parts):
            # causal & window(left, right) == window(left, 0), which itself implies causal.
            parts = [qm.SlidingWindowMask(p.left, 0) if p in windows else p
                     for p in parts if not isinstance(p, qm.CausalMask)]
        unique = []
        for p in parts:  # a packed batch's segments arrive twice (see ``remapped``)
            if not any(_same_segments(p, u) for u in unique):
                unique.append(p)
        return functools.reduce(lambda a, b: a & b, unique) if unique else None

    def either(self, cells):
        parts = [self.translate(f) for f in cells["mask_functions"]]
        if any(p is None for p in parts):
            return None
        return functools.reduce(lambda a, b: a | b, parts)

    def window_overlay(self, cells):
        # kv > q - w, unbounded to the right: a right reach no query/key pair can exceed.
        reach = self.nq + self.nk + abs(self.q_offset - self.kv_offset)
        return qm.SlidingWindowMask(cells["sliding_window"] - 1, reach)

    def bidirectional_window(self, cells):
        w = cells["sliding_window"]
        return qm.SlidingWindowMask(w, w)

    def chunked(self, cells):
        size, left = cells["chunk_size"], torch.as_tensor(cells["left_padding"]).view(-1, 1)
        q = (torch.arange(self.nq, device=left.device) + self.q_offset - left) // size
        kv = (torch.arange(self.nk, device=left.device) + self.kv_offset - left) // size
        return qm.segments(q.expand(self.batch, -1), kv.expand(self.batch, -1))

    def blockwise(self, cells):
        ids = cells["block_sequence_ids"]
        q, kv = self.rows(ids, self.q_offset, self.nq), self.rows(ids, self.kv_offset, self.nk)
        # Negative groups (text) never match: different sentinels on each side.
        return qm.segments(q.clamp(min=-1), torch.where(kv < 0, -2, kv))

    def packed(self, cells):
        self.saw_packed = True
        ids = cells["packed_sequence_mask"]
        return qm.segments(self.rows(ids, self.q_offset, self.nq),
                           self.rows(ids, self.kv_offset, self.nk))

    def padding(self, cells):
        return keys_mask(cells["padding_mask"][:, self.kv_offset:self.kv_offset + self.nk])

    def remapped(self, cells):
        """f at per-sequence positions. transformers always intersects it with the packed
        sequences' segments; within one sequence positions step by 1, so a rule that depends
        only on q - kv (causal, windows) is unchanged: f & segments(ids)."""
        inner, positions = cells["mask_function"], cells["position_ids"]
        mask = self.translate(inner)
        same_grid = self.nq == self.nk and self.q_offset == self.kv_offset == 0
        if not (same_grid and _shift_invariant(mask)):
            return qm.custom_mask(_Absolute(
                hf.remap_positions_for_packed_sequence(inner, positions),
                self.q_offset, self.kv_offset))
        first = positions[:, :1] - 1
        ids = (torch.diff(positions, prepend=first, dim=-1) != 1).cumsum(-1)
        segments = qm.segments(ids.expand(self.batch, -1))
        return segments if mask is None else mask & segments


def _shift_invariant(mask) -> bool:
    """Whether the rule depends on positions only through q - kv."""
    if mask is None or isinstance(mask, (qm.CausalMask, qm.SlidingWindowMask)):
        return True
    if isinstance(mask, qm.AndMask):  # OrMask too
        return _shift_invariant(mask.a) and _shift_invariant(mask.b)
    return False


def _same_segments(a, b) -> bool:
    return (isinstance(a, qm.SegmentMask) and isinstance(b, qm.SegmentMask)
            and a.q_ids.shape == b.q_ids.shape and a.kv_ids.shape == b.kv_ids.shape
            and torch.equal(a.q_ids, b.q_ids) and torch.equal(a.kv_ids, b.kv_ids))


_HANDLERS = [
    (code, handler)
    for code, handler in (
        (hf.causal_mask_function.__code__, _Context.causal),
        (hf.bidirectional_mask_function.__code__, _Context.bidirectional),
        (_code_of("and_masks", hf.causal_mask_function), _Context.both),
        (_code_of("or_masks", hf.causal_mask_function), _Context.either),
        (_code_of("sliding_window_overlay", 1), _Context.window_overlay),
        (_code_of("sliding_window_bidirectional_overlay", 1), _Context.bidirectional_window),
        (_code_of("chunked_overlay", 1, None), _Context.chunked),
        (_code_of("blockwise_overlay", None), _Context.blockwise),
        (_code_of("packed_sequence_mask_function", None), _Context.packed),
        (_code_of("padding_mask_function", None), _Context.padding),
        (_code_of("remap_positions_for_packed_sequence", hf.causal_mask_function, None),
         _Context.remapped),
    )
    if code is not None
]


# The handlers of the plain causal and bidirectional functions, which read no closure.
_WITHOUT_CLOSURE = (_Context.causal, _Context.bidirectional)


# A composition's parameters (windows, chunk sizes, packed ids) live in its closures, which
# torch.compile cannot read: it runs this part eagerly (one graph break per mask built). The
# plain causal and bidirectional masks, and padding, are traced.
@torch.compiler.disable
def _translated_eagerly(ctx: _Context, fn):
    return ctx.translate(fn)


def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                  kv_offset: int = 0, mask_function=hf.causal_mask_function,
                  attention_mask: Tensor | None = None, **kwargs) -> qm.Mask:
    """transformers' mask interface (``AttentionMaskInterface``) for qkv.

    Args:
        batch_size, q_length, kv_length: B, Nq and Nk of the layer's attention.
        q_offset, kv_offset: absolute positions of the first query and the first key.
        mask_function: ``fn(b, h, q, kv) -> bool`` over absolute positions.
        attention_mask: (B, L) padding mask, 1 = a real token, L >= kv_offset + Nk or shorter
            (missing keys count as padding, as transformers pads it).
        kwargs: transformers' hints for its own backends (``allow_is_causal_skip``, ...).

    Returns:
        A qkv mask for ``qkv.attention`` over (Nq, Nk) (``Unmasked()`` when every key is
        allowed), as ``Prepared``, the type transformers keeps as it is when it comes back.
    """
    unknown = sorted(set(kwargs) - _HINTS)
    if unknown:
        raise TypeError(f"qkv mask function: unsupported argument {unknown[0]!r}")
    ctx = _Context(batch_size, q_length, kv_length, q_offset, kv_offset)
    if torch.compiler.is_compiling() and _handler(mask_function) not in _WITHOUT_CLOSURE:
        mask = _translated_eagerly(ctx, mask_function)
    else:
        mask = ctx.translate(mask_function)
    # A decoding step that transformers may compile (a static cache: its full layers' offsets are
    # tensors, and it withholds allow_is_causal_skip from a one-query step) gets a mask whose
    # types and Python numbers are the same at every step and prompt length, because dynamo
    # guards on both and would recompile for a new value: padding as the per-key mask whatever
    # its runs, and the offsets' shift as a tensor, never compared.
    compiled_step = (isinstance(q_offset, Tensor) or isinstance(kv_offset, Tensor)
                     or (q_length == 1 and kwargs.get("allow_is_causal_skip") is False))
    if attention_mask is not None:
        padded = hf.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        keep = padded[:, kv_offset:kv_offset + kv_length]
        keys = KeyMask(keep.bool()) if compiled_step else keys_mask(keep)
        mask = keys if mask is None else (mask if keys is None else mask & keys)
    if mask is None:
        mask = Unmasked()
    elif compiled_step:
        shift = q_offset - kv_offset
        if not isinstance(shift, Tensor):
            shift = torch.tensor(shift, device=kwargs.get("device"))
        mask = Shifted(mask, shift)
    elif q_offset - kv_offset != kv_length - q_length:
        mask = Shifted(mask, q_offset - kv_offset)
    return Prepared(mask, (batch_size, 1, q_length, kv_length), packed=ctx.saw_packed)
