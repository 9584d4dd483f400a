"""Score modifiers: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, applied before softmax.

Built-in modifiers also take ``offset = Nk - Nq`` so that a query's position is bottom-right
aligned (``q_idx + offset``), which keeps ALiBi and relative bias right under a KV cache.
User callables keep FlexAttention's five-argument signature and semantics (one score at a
time, ``pointwise``) and receive raw query indices.
Each modifier is written once here; every engine evaluates the same function.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .masks.base import as_4d, broadcast_index
from .pointwise import pointwise
from .structure import Node, reads, values_readable


class ScoreMod(Node):
    """Base class for score modifiers. ``tensors()`` lists the tensors it reads, so engines can
    route gradients to learnable ones (relative-bias tables, ALiBi slopes)."""

    def __call__(self, score: Tensor, b, h, q_idx, kv_idx, offset: int = 0) -> Tensor:
        raise NotImplementedError

    def tensors(self) -> tuple[Tensor, ...]:
        return ()

    def check_heads(self, heads: int) -> None:
        """Raise ValueError when the modifier holds per-head values for another head count."""

    def then(self, other) -> ScoreMod:
        """Apply ``self`` and then ``other``."""
        return ChainedScoreMod([self, as_score_mod(other)])


class ChainedScoreMod(ScoreMod):
    def __init__(self, mods: Sequence[ScoreMod]):
        self.mods = []
        for mod in mods:
            self.mods.extend(mod.mods if isinstance(mod, ChainedScoreMod) else [mod])

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        for mod in self.mods:
            score = mod(score, b, h, q_idx, kv_idx, offset)
        return score

    def tensors(self):
        return tuple(t for mod in self.mods for t in mod.tensors())

    def check_heads(self, heads: int) -> None:
        for mod in self.mods:
            mod.check_heads(heads)

    def __repr__(self) -> str:
        return " then ".join(repr(m) for m in self.mods)


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's geometric slopes: 2^(-8/n), 2^(-16/n), ... for n a power of two;
    otherwise those of the nearest lower power of two, then every other slope of the next."""
    if not isinstance(num_heads, int) or num_heads <= 0:
        raise ValueError(f"alibi: num_heads must be a positive int; got {num_heads!r}")

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    lower = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two(lower)
    if lower < num_heads:
        slopes += power_of_two(2 * lower)[0::2][: num_heads - lower]
    return torch.tensor(slopes, dtype=torch.float32)


class Alibi(ScoreMod):
    """score - slope[h] * |position(q) - kv_idx| (equals the paper's bias under causal masking)."""

    def __init__(self, slopes: Tensor):
        if slopes.dim() != 1:
            raise ValueError(f"alibi: slopes must be 1-D (H,); got shape {tuple(slopes.shape)}")
        self.slopes = slopes

    def tensors(self):
        return (self.slopes,)

    def check_heads(self, heads: int) -> None:
        if self.slopes.numel() != heads:
            raise ValueError(
                f"alibi has {self.slopes.numel()} slopes (heads) but the attention has {heads} "
                f"query heads; use qkv.alibi({heads})")

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        distance = (q_idx + offset - kv_idx).abs().to(score.dtype)
        return score - self.slopes.to(score)[h] * distance

    def __repr__(self) -> str:
        return f"alibi({self.slopes.numel()} heads)"


def relative_position_bucket(
    relative_position: Tensor, num_buckets: int, max_distance: int, bidirectional: bool
) -> Tensor:
    """T5's bucketing of ``kv_idx - q_idx``: exact for small offsets, logarithmic up to
    ``max_distance``, then clamped."""
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = bucket + (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    # Distances < max_exact take the exact bucket; the clamp only keeps their unused log finite.
    log_ratio = torch.log(distance.clamp(min=1).float() / max_exact) / math.log(
        max_distance / max_exact
    )
    large = max_exact + (log_ratio * (num_buckets - max_exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return bucket + torch.where(is_small, distance, large)


class RelativeBias(ScoreMod):
    """T5 relative position bias: score + table[bucket(kv_idx - position(q)), h]."""

    def __init__(self, table: Tensor, num_buckets: int, max_distance: int, bidirectional: bool):
        if table.dim() != 2 or table.shape[0] != num_buckets:
            raise ValueError(
                f"relative_bias: table must have shape (num_buckets={num_buckets}, H); "
                f"got {tuple(table.shape)}"
            )
        if num_buckets < 2 or max_distance <= num_buckets // (2 if bidirectional else 1) // 2:
            raise ValueError(
                "relative_bias: need num_buckets >= 2 and max_distance larger than the exact "
                f"range; got num_buckets={num_buckets}, max_distance={max_distance}"
            )
        self.table = table
        self.num_buckets, self.max_distance, self.bidirectional = (
            num_buckets,
            max_distance,
            bidirectional,
        )

    def tensors(self):
        return (self.table,)

    def check_heads(self, heads: int) -> None:
        if self.table.shape[1] != heads:
            raise ValueError(
                f"relative_bias has a table for {self.table.shape[1]} heads but the attention "
                f"has {heads} query heads")

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        relative = kv_idx - (q_idx + offset)
        bucket = relative_position_bucket(
            relative, self.num_buckets, self.max_distance, self.bidirectional
        )
        return score + self.table.to(score)[bucket, h]

    def __repr__(self) -> str:
        return f"relative_bias({self.num_buckets} buckets, max_distance={self.max_distance})"


class Softcap(ScoreMod):
    """cap * tanh(score / cap): bounds logits smoothly (Gemma 2, Grok).

    ``cap``: a positive number, or a 0-d tensor (a value torch.compile does not specialize
    on, so a new one does not recompile; learnable if it requires grad)."""

    def __init__(self, cap):
        is_number = isinstance(cap, (int, float)) and not isinstance(cap, bool)
        is_scalar = (isinstance(cap, Tensor) and cap.dim() == 0 and cap.is_floating_point())
        if is_scalar:  # a tensor's value is unknown while torch.compile traces
            bad = values_readable() and not bool(cap > 0)
        else:
            bad = not (is_number and cap > 0)
        if bad:
            raise ValueError(f"softcap: cap must be a positive number or a 0-d float tensor; "
                             f"got {cap!r}")
        self.cap = cap if is_scalar else float(cap)

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        cap = self.cap.to(score) if isinstance(self.cap, Tensor) else self.cap
        return cap * torch.tanh(score / cap)

    def tensors(self):
        return (self.cap,) if isinstance(self.cap, Tensor) else ()

    def __repr__(self) -> str:
        return f"softcap({float(self.cap):g})"


class UserScoreMod(ScoreMod):
    """A FlexAttention-style callable ``fn(score, b, h, q_idx, kv_idx)``, evaluated with
    FlexAttention's semantics: once per score, on 0-d tensors (``pointwise``)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        return pointwise(self.fn, score, b, h, q_idx, kv_idx)

    def tensors(self):
        return captured_tensors(self.fn)

    def __repr__(self) -> str:
        return f"score_mod({getattr(self.fn, '__name__', self.fn)!r})"


class AdditiveBias(ScoreMod):
    """score + bias[b, h, q_idx, kv_idx]: SDPA's additive float ``attn_mask``, added after
    the scale and any other modifier, as a mask is applied last. ``bias`` is broadcastable to
    (B, H, Nq, Nk); gradients reach it when it requires them, as in SDPA."""

    def __init__(self, bias: Tensor):
        self.bias = as_4d(bias)

    def tensors(self):
        return (self.bias,)

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        return score + broadcast_index(self.bias, b, h, q_idx, kv_idx)

    def __repr__(self) -> str:
        return f"additive_bias({tuple(self.bias.shape)})"


def captured_tensors(fn: Callable) -> tuple[Tensor, ...]:
    """Tensors a callable reads through its closure, the module globals it names, defaults, or
    (for a Module) parameters."""
    found: list[Tensor] = []
    if isinstance(fn, torch.nn.Module):
        found.extend(fn.parameters())
    for kind, _, value in reads(fn):
        if isinstance(value, Tensor):
            found.append(value)
        elif kind != "default" and isinstance(value, ScoreMod):
            found.extend(value.tensors())
        elif kind != "default" and isinstance(value, torch.nn.Module):
            found.extend(value.parameters())
    unique = {id(t): t for t in found}  # a tensor read twice still gets one gradient
    return tuple(unique.values())


def as_score_mod(score_mod) -> ScoreMod | None:
    """None, a ScoreMod, a callable, or a sequence of them (applied in order) -> ScoreMod."""
    if score_mod is None or isinstance(score_mod, ScoreMod):
        return score_mod
    if isinstance(score_mod, (list, tuple)):
        if not score_mod:
            return None
        return ChainedScoreMod([as_score_mod(m) for m in score_mod])
    if callable(score_mod):
        return UserScoreMod(score_mod)
    raise TypeError(
        "score_mod must be None, a callable score_mod(score, b, h, q_idx, kv_idx), or a list of "
        f"them; got {type(score_mod).__name__}"
    )


def modified_scores(raw: Tensor, index, offset: int, *, scale=None, score_mod=None, mask=None,
                    inplace: bool = False) -> Tensor:
    """The elementwise part of attention, the one place it is written: raw similarity scores
    times ``scale``, then the score modifier, then -inf where the mask forbids.

    Args:
        raw: the pairwise term's scores in any layout: (B, H, Nq, Nk), a tile, or per-edge
            (B, E, H, 1).
        index: (b, h, q_idx, kv_idx) broadcastable to ``raw``'s layout.
        offset: Nk - Nq, for bottom-right aligned modifiers and masks.
        scale: None, a float, or a tensor broadcastable to ``raw``.
        score_mod, mask: a ``ScoreMod`` and a ``Mask`` (its ``mask_mod``), or None.
        inplace: scale and mask ``raw``'s memory (nothing may need its gradient).

    Returns:
        Scores of ``raw``'s shape and dtype, contiguous after a modifier.
    """
    s = raw
    if scale is not None:
        s = s.mul_(scale) if inplace and not isinstance(scale, Tensor) else s * scale
    if score_mod is not None:
        s = score_mod(s, *index, offset)
        if s.shape != raw.shape:
            s = s.expand(raw.shape)
        s = s.to(raw.dtype).contiguous()
    if mask is not None:
        allowed = torch.as_tensor(mask.mask_mod(*index, offset), device=raw.device)
        s = s.masked_fill_(~allowed, float("-inf")) if inplace else s.masked_fill(
            ~allowed, float("-inf"))
    return s


def alibi(num_heads: int | None = None, slopes: Tensor | None = None) -> ScoreMod:
    """ALiBi linear distance penalty with the standard geometric slopes for ``num_heads``;
    pass ``slopes`` (H,) instead, e.g. an ``nn.Parameter``, to learn them."""
    if slopes is None:
        if num_heads is None:
            raise ValueError("alibi: pass num_heads or slopes")
        slopes = alibi_slopes(num_heads)
    return Alibi(slopes)


def relative_bias(
    table: Tensor, num_buckets: int = 32, max_distance: int = 128, bidirectional: bool = True
) -> ScoreMod:
    """T5 relative position bias from a learnable ``table`` of shape (num_buckets, H)."""
    return RelativeBias(table, num_buckets, max_distance, bidirectional)


def softcap(cap) -> ScoreMod:
    """Soft logit capping: cap * tanh(score / cap)."""
    return Softcap(cap)
