"""The spellings users bring from SDPA, FlexAttention and ``nn.MultiheadAttention``, read as
those APIs mean them and turned into qkv's own: a mask, a score modifier, 4-D tensors.

- SDPA: ``attn_mask`` (bool, True = may attend; or float, added to the scores), ``is_causal``
  (top-left aligned), ``enable_gqa``, and unbatched 3-D inputs (H, N, D).
- FlexAttention: ``block_mask`` (a ``BlockMask``), or a bare ``mask_mod`` as the mask.
- Anything else known from those APIs gets one line naming the qkv form.

A float mask whose entries are only 0 and -inf is a bool mask (the same numbers: adding 0
changes nothing), and a bool mask that is the causal triangle or all True becomes
``qkv.causal`` or no mask, so that such calls keep SDPA's and the fused engines' fast paths.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .masks import CausalMask, Mask, TensorMask, causal
from .masks.flex import FlexBlockMask, is_block_mask
from .masks.rules import CustomMask, TopLeftCausalMask
from .scores import AdditiveBias, ScoreMod
from .structure import values_readable

# Other APIs' keywords -> the qkv spelling, for the one-line error.
FOREIGN_KEYWORDS = {
    "need_weights": "return_weights=True (nn.MultiheadAttention's need_weights)",
    "average_attn_weights": "return_weights=True, then weights.mean(dim=1)",
    "key_padding_mask": "mask=qkv.padding(lengths), or a bool mask where True = may attend "
                        "(nn.MultiheadAttention's True means masked out)",
    "attn_bias": "attn_mask=bias (an additive float mask)",
    "causal": "is_causal=True (top-left, as SDPA) or mask=qkv.causal() (bottom-right)",
    "softmax_scale": "scale=",
    "window_size": "mask=qkv.sliding_window(left, right)",
    "alibi_slopes": "score_mod=qkv.alibi(slopes=slopes)",
    "softcap": "score_mod=qkv.softcap(cap)",
    "dropout": "dropout_p=",
    "mask_mod": "mask=mask_mod (a FlexAttention mask_mod) or mask=qkv.custom_mask(mask_mod)",
    "return_aux": "return_lse=True",
    "kernel_options": "nothing: each qkv engine picks its own tiles; leave kernel_options out",
}


def reject_keywords(unknown: dict, known: list[str]) -> None:
    """One line for keywords ``qkv.attention`` does not take: the qkv form where one exists."""
    if not unknown:
        return
    name = next(iter(unknown))
    hint = FOREIGN_KEYWORDS.get(name)
    if hint is not None:
        raise TypeError(f"qkv.attention has no {name!r}; use {hint}")
    raise TypeError(f"qkv.attention got an unexpected keyword argument {name!r}; it takes "
                    f"{', '.join(known)}")


def unbatch(q, k, v) -> bool:
    """Whether q, k and v are all SDPA's unbatched (H, N, D) (a mix is refused later, with
    the shape check of every call)."""
    return all(isinstance(t, Tensor) and t.dim() == 3 for t in (q, k, v))


def split_mask(value, name: str, shape: tuple[int, int, int, int]) -> tuple[
        Mask | None, ScoreMod | None]:
    """Any mask spelling -> (a qkv mask, an additive bias), either None.

    ``value``: None, a qkv mask, a bool tensor (True = may attend), a float tensor (added to
    the scores, as SDPA adds it), a FlexAttention ``BlockMask``, or a ``mask_mod`` callable.
    ``shape``: the call's (B, H, Nq, Nk)."""
    if value is None or isinstance(value, Mask):
        return value, None
    if is_block_mask(value):
        return FlexBlockMask(value), None
    if isinstance(value, Tensor):
        _check_broadcast(value, name, shape)
        if value.dtype == torch.bool:
            return recognized(value, shape), None
        if value.is_floating_point():
            return _float_mask(value, shape)
        raise TypeError(f"{name} must be a bool or float tensor; got dtype {value.dtype}")
    if callable(value):
        if _positional_count(value) == 5:
            raise TypeError(f"{name} got a 5-argument callable, a score modifier "
                            "fn(score, b, h, q_idx, kv_idx): pass it as score_mod=")
        return CustomMask(value), None
    raise TypeError(f"{name} must be None, a bool or float tensor, a qkv mask, a FlexAttention "
                    f"BlockMask or a mask_mod(b, h, q_idx, kv_idx); got {type(value).__name__}")


def _positional_count(fn) -> int | None:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


def _check_broadcast(t: Tensor, name: str, shape) -> None:
    if t.dim() > 4 or any(s not in (1, n) for s, n in zip(reversed(t.shape), reversed(shape),
                                                          strict=False)):
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to (B, H, Nq, "
                         f"Nk) = {tuple(shape)}")


def _float_mask(bias: Tensor, shape) -> tuple[Mask | None, ScoreMod | None]:
    """An additive mask: a bool mask where it holds only 0 and -inf (and needs no gradient),
    else a bias, with its -inf entries also a mask so that the engines skip empty tiles.
    A bias without -inf costs one pass over it here (its smallest and largest values)."""
    if bias.requires_grad or not values_readable():
        return None, AdditiveBias(bias)
    low, high = (float(x) for x in torch.aminmax(bias))
    if low > float("-inf"):
        return (None, None) if low == high == 0 else (None, AdditiveBias(bias))
    blocked = torch.isneginf(bias)
    if high <= 0 and bool(((bias == 0) | blocked).all()):
        return recognized(~blocked, shape), None
    return recognized(~blocked, shape), AdditiveBias(bias)


def recognized(allowed: Tensor, shape) -> Mask | None:
    """A bool mask as the structure it has: None when all True, ``qkv.causal()`` (either
    alignment) when it is the causal triangle, else the tensor itself."""
    if not values_readable() or allowed.dim() < 2:
        return TensorMask(allowed)
    if bool(allowed.all()):
        return None
    nq, nk = shape[2], shape[3]
    if allowed.shape[-2:] == (nq, nk) and allowed.numel() == nq * nk:
        grid = allowed.reshape(nq, nk)
        ones = torch.ones(nq, nk, dtype=torch.bool, device=allowed.device)
        if torch.equal(grid, ones.tril(nk - nq)):
            return CausalMask()
        if torch.equal(grid, ones.tril(0)):
            return TopLeftCausalMask()
    return TensorMask(allowed)


def combine(parts: list) -> Mask | None:
    """The masks of ``parts`` (None skipped) joined with &."""
    found = [m for m in parts if m is not None]
    if not found:
        return None
    out = found[0]
    for m in found[1:]:
        out = out & m
    return out


def sdpa_causal(is_causal, nq: int, nk: int) -> Mask | None:
    """SDPA's ``is_causal``: top-left aligned, which is qkv's causal when Nq == Nk."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool; got {is_causal!r}")
    if not is_causal:
        return None
    return causal() if nq == nk else causal(align="top_left")


def check_gqa(enable_gqa, heads: int, kv_heads: int) -> None:
    """SDPA's ``enable_gqa``: False refuses grouped heads, as SDPA does. qkv groups heads
    whenever H is a multiple of Hkv, so None (the default) and True allow them."""
    if enable_gqa is None:
        return
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be a bool; got {enable_gqa!r}")
    if not enable_gqa and heads != kv_heads:
        raise ValueError(f"enable_gqa=False, but q has H={heads} heads and k, v Hkv={kv_heads}: "
                         "pass enable_gqa=True (or leave it out) for grouped heads")
