"""How scores become weights: softmax, as in the paper, and the alternatives the literature
uses, each one definition that the reference and every engine read.

Notation: s_ij is the score after similarity, scale and score modifier; M the mask (True =
may attend); Nk the number of keys. Every weighting gives 0 where M is False, and a row with
no allowed key gives zeros, with zero gradients.

| name | object | w_ij |
|---|---|---|
| "softmax" | ``softmax()`` | exp(s_ij) / Σ_{j∈M} exp(s_ij) |
| "sigmoid" | ``sigmoid(bias=None)`` | σ(s_ij + b); b = −log Nk by default, a float, or (H,) |
| "softpick" | ``softpick(eps=1e-6)`` | relu(e^s − 1) / (Σ_{j∈M} \\|e^s − 1\\| + eps) |
| "stick_breaking" | ``stick_breaking(include_self)`` | β_ij ∏_{l∈M, j<l<i} (1 − β_il) |
| "relu" | ``relu()`` | relu(s_ij) / Nk |
| "identity" | ``identity()`` | s_ij |
| — | ``elementwise(fn)`` | fn(s_ij) |

(β = σ(s); ``include_self=False`` by default.)

What an engine derives its loop from is the weighting's ``carry``, the row statistic that
key blocks pass on:

- ``Carry.NONE``: w = f(s), one score at a time. ``score_fn(nk)`` is f as a score modifier
  (``ScoreMod``), which the engines trace into their loops as any modifier, derivative
  included; a block's outputs simply add. (sigmoid, relu, identity, elementwise)
- ``Carry.MAX_SUM``: w = e^s a(s) / (Σ_{j∈M} e^s b(s) + eps). A row carries a running max
  m, never below ``max_floor``, and the sum Σ e^(s−m) b(s); two blocks combine as softmax's
  do, by rescaling to the larger max. The statistic saved is log Z, Z the denominator, and
  the gradient is d(loss)/ds = e^(s − log Z) (a'(s) dp − b'(s) δ), δ = dout·out, where
  a' = (e^s a)' / e^s and b' likewise (``slopes``). (softmax: a = b = 1; softpick)
- ``Carry.STICK``: keys are visited from the nearest to the farthest; a row carries
  Σ softplus(s) over the keys visited, the log of the stick they left, and a block's weights
  are its own stick-breaking times that stick. (stick_breaking)
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .kept import Kept
from .masks import EMPTY, FULL, CausalMask, Mask, causal
from .scores import ScoreMod, captured_tensors
from .structure import Node, values_readable


class Carry(enum.Enum):
    """The row statistic a weighting carries from one key block to the next."""

    NONE = "none"
    MAX_SUM = "max_sum"
    STICK = "stick"


class Weighting(Node):
    """Base class of the weightings: ``name``, ``carry``, and the dense weights the reference
    computes (``weights``)."""

    name: str = ""
    carry: Carry = Carry.NONE

    def weights(self, s: Tensor, allowed: Tensor, pos_q: Tensor, kv_idx: Tensor,
                heads: Tensor | None = None) -> Tensor:
        """The weights (B, H, Nq, Nk) of scores s (B, H, Nq, Nk), 0 where the bool
        ``allowed`` (broadcastable to s) is False. pos_q (Nq, 1) holds each query's key
        position (bottom-right aligned), kv_idx (1, Nk) the keys'; ``heads`` (1, H, 1, 1)
        the query heads s holds, for per-head values (None: all, in order)."""
        raise NotImplementedError

    def tensors(self) -> tuple[Tensor, ...]:
        return ()

    def check_heads(self, heads: int) -> None:
        """Raise ValueError when the weighting holds per-head values for another head count."""

    def for_context(self, length: int) -> Weighting:
        """The weighting with the sequence length it reads (sigmoid's −log N, relu's 1/N)
        fixed to ``length``, a model's context, instead of each call's Nk: a model then weighs
        a row alike in its whole forward and in KV-cache decoding, whose calls have fewer keys."""
        return self

    @property
    def is_softmax(self) -> bool:
        return isinstance(self, Softmax)

    def __repr__(self) -> str:
        return f"{self.name}()"


def _safe(s: Tensor, allowed: Tensor) -> Tensor:
    """s with 0 where not allowed: masked entries (often -inf) never reach a formula, so
    they give neither NaN nor a gradient."""
    return torch.where(allowed, s, torch.zeros((), dtype=s.dtype, device=s.device))


def _zero_masked(w: Tensor, allowed: Tensor) -> Tensor:
    return torch.where(allowed, w, torch.zeros((), dtype=w.dtype, device=w.device))


# -- Carry.NONE: one score at a time ----------------------------------------------------------
class Elementwise(Weighting):
    """w = f(s): ``score_fn(nk)`` is f as a score modifier, which the engines trace."""

    carry = Carry.NONE

    def score_fn(self, nk: int) -> ScoreMod | None:
        """f for a call with ``nk`` keys, as a ``ScoreMod`` (None: f(s) = s)."""
        raise NotImplementedError

    def weights(self, s, allowed, pos_q, kv_idx, heads=None):
        fn = self.score_fn(s.shape[-1])
        safe = _safe(s, allowed)
        if fn is None:
            return _zero_masked(safe, allowed)
        b = torch.arange(s.shape[0], device=s.device).view(-1, 1, 1, 1)
        h = torch.arange(s.shape[1], device=s.device).view(1, -1, 1, 1) if heads is None \
            else heads
        w = fn(safe, b, h, pos_q.view(1, 1, -1, 1), kv_idx.view(1, 1, 1, -1))
        return _zero_masked(w.expand(s.shape).to(s.dtype), allowed)


class _SigmoidFn(ScoreMod):
    """σ(s + bias): bias a float, or a tensor (H,) read per head."""

    def __init__(self, bias):
        self.bias = bias

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        if isinstance(self.bias, Tensor):
            return torch.sigmoid(score + self.bias.to(score)[h])
        return torch.sigmoid(score + self.bias)

    def tensors(self):
        return (self.bias,) if isinstance(self.bias, Tensor) else ()


class Sigmoid(Elementwise):
    """σ(s + b) (Ramapuram et al., "Theory, Analysis, and Best Practices for Sigmoid
    Self-Attention", ICLR 2025): no normalization across keys. ``bias`` None means −log Nk,
    the paper's choice; a float; or a tensor (H,), learnable."""

    name = "sigmoid"

    def __init__(self, bias=None):
        if isinstance(bias, Tensor):
            if bias.dim() != 1 or not bias.is_floating_point():
                raise ValueError(f"sigmoid: bias must be a float, None (-log Nk) or a float "
                                 f"tensor of shape (H,); got shape {tuple(bias.shape)}")
        elif bias is not None:
            if (isinstance(bias, bool) or not isinstance(bias, (int, float))
                    or (values_readable() and not math.isfinite(bias))):
                raise TypeError(f"sigmoid: bias must be a finite number, None (-log Nk) or a "
                                f"tensor of shape (H,); got {bias!r}")
            bias = float(bias)
        self.bias = bias

    def score_fn(self, nk):
        return _SigmoidFn(-math.log(nk) if self.bias is None else self.bias)

    def for_context(self, length):
        return Sigmoid(-math.log(length)) if self.bias is None else self

    def tensors(self):
        return (self.bias,) if isinstance(self.bias, Tensor) else ()

    def check_heads(self, heads):
        if isinstance(self.bias, Tensor) and self.bias.numel() != heads:
            raise ValueError(f"sigmoid has a bias for {self.bias.numel()} heads but the "
                             f"attention has {heads} query heads")

    def __repr__(self):
        bias = "-log Nk" if self.bias is None else (
            f"({self.bias.numel()},) tensor" if isinstance(self.bias, Tensor) else self.bias)
        return f"sigmoid(bias={bias})"


class _ReluFn(ScoreMod):
    def __init__(self, inv_nk: float):
        self.inv_nk = inv_nk

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        return torch.relu(score) * self.inv_nk


class Relu(Elementwise):
    """relu(s) / N (Wortsman et al., "Replacing softmax with ReLU in Vision Transformers",
    2023); ``length`` N, None for each call's Nk."""

    name = "relu"

    def __init__(self, length: int | None = None):
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                                   or length < 1):
            raise ValueError(f"relu: length must be a positive int or None (Nk); got "
                             f"{length!r}")
        self.length = length

    def score_fn(self, nk):
        return _ReluFn(1.0 / (nk if self.length is None else self.length))

    def for_context(self, length):
        return Relu(length) if self.length is None else self

    def __repr__(self):
        return f"relu(length={'Nk' if self.length is None else self.length})"


class Identity(Elementwise):
    """w = s: the scores themselves. With similarity="cosine" and scale=1.0 this is the
    content-based cosSim(QKᵀ)V that softmax attention replaced."""

    name = "identity"

    def score_fn(self, nk):
        return None


class _UserFn(ScoreMod):
    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        return self.fn(score)

    def tensors(self):
        return captured_tensors(self.fn)


class UserElementwise(Elementwise):
    """fn(s): a user's elementwise function of the score, written in torch operations on a
    tensor of scores. The engines trace it as a score modifier, derivative included;
    gradients reach the tensors it reads."""

    name = "elementwise"

    def __init__(self, fn: Callable):
        if not callable(fn):
            raise TypeError(f"elementwise: fn must be a callable fn(score) -> weight; got "
                            f"{type(fn).__name__}")
        self.fn = fn

    def score_fn(self, nk):
        return _UserFn(self.fn)

    def tensors(self):
        return captured_tensors(self.fn)

    def __repr__(self):
        return f"elementwise({getattr(self.fn, '__name__', self.fn)!r})"


# -- Carry.MAX_SUM: normalized over the row ----------------------------------------------------
class Normalized(Weighting):
    """w = e^s a(s) / (Σ_{j∈M} e^s b(s) + eps), carried as a running max (never below
    ``max_floor``) and sum."""

    carry = Carry.MAX_SUM
    max_floor = float("-inf")
    eps = 0.0

    def terms(self, s: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
        """(e^(s−m) a(s), e^(s−m) b(s)): the numerator and denominator terms of scores s
        relative to a max m >= s (broadcastable)."""
        raise NotImplementedError

    def slopes(self, s: Tensor) -> tuple[Tensor | float, Tensor | float]:
        """(a', b'): (e^s a)' / e^s and (e^s b)' / e^s at s, for the gradient."""
        raise NotImplementedError

    def weights(self, s, allowed, pos_q, kv_idx, heads=None):
        safe = _safe(s, allowed)
        low = torch.full((), float("-inf"), dtype=s.dtype, device=s.device)
        m = torch.where(allowed, safe, low).amax(-1, keepdim=True)
        m = m.clamp_min(self.max_floor) if self.max_floor > float("-inf") else m
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
        num, den = self.terms(safe, m)
        num, den = _zero_masked(num, allowed), _zero_masked(den, allowed)
        z = den.sum(-1, keepdim=True) + self.eps * torch.exp(-m)
        return num / torch.where(z == 0, torch.ones_like(z), z)


class Softmax(Normalized):
    """exp(s) / Σ exp(s), as in "Attention Is All You Need"."""

    name = "softmax"

    def terms(self, s, m):
        e = torch.exp(s - m)
        return e, e

    def slopes(self, s):
        return 1.0, 1.0


class Softpick(Normalized):
    """relu(e^s − 1) / (Σ_{j∈M} |e^s − 1| + eps) (Zuhri et al., "Softpick: No Attention Sink,
    No Massive Activations with Rectified Softmax", 2025): weights may be exactly 0 and rows
    may sum to less than 1, so no key has to absorb the rest. The max never drops below 0, so
    e^(−m) stays at most 1 for rows of very negative scores."""

    name = "softpick"
    max_floor = 0.0

    def __init__(self, eps: float = 1e-6):
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
            raise ValueError(f"softpick: eps must be a positive number; got {eps!r}")
        self.eps = float(eps)

    def terms(self, s, m):
        # e^(s-m) - e^(-m) = e^(-m) (e^s - 1): expm1 keeps the digits near s = 0.
        d = torch.where(s < 1, torch.expm1(s.clamp_max(1)) * torch.exp(-m),
                        torch.exp(s - m) - torch.exp(-m))
        return torch.relu(d), d.abs()

    def slopes(self, s):
        return (s > 0).to(s.dtype), torch.sign(s)

    def __repr__(self):
        return f"softpick(eps={self.eps:g})"


# -- Carry.STICK: stick-breaking ---------------------------------------------------------------
# Masks found to keep every query to the keys before it, by layout key and shape.
_IN_ORDER = Kept(64)


class StickBreaking(Weighting):
    """β_ij ∏_{l∈M, j<l<i} (1 − β_il), β = σ(s) (Tan et al., "Scaling Stick-Breaking
    Attention", ICLR 2025): each key takes a share β of the stick the nearer keys left, so
    rows sum to at most 1 and the weights encode order without positions. Keys j < i (j <= i
    and l <= i with ``include_self``), positions bottom-right aligned as ``qkv.causal()``."""

    name = "stick_breaking"
    carry = Carry.STICK

    def __init__(self, include_self: bool = False):
        if not isinstance(include_self, bool):
            raise TypeError(f"stick_breaking: include_self must be a bool; got "
                            f"{include_self!r}")
        self.include_self = include_self

    def in_order(self, pos_q: Tensor, kv_idx: Tensor) -> Tensor:
        """The keys a query may break the stick over: j < i, or j <= i with include_self."""
        return kv_idx <= pos_q if self.include_self else kv_idx < pos_q

    def check_mask(self, mask: Mask | None, batch: int, heads: int, nq: int, nk: int,
                   device=None) -> None:
        """Raise ValueError when ``mask`` lets some query see a key after its own position:
        the stick is broken in key order, from the query back. Tiles are classified first,
        and only those that hold both allowed and forbidden later keys are evaluated. A mask
        with a layout key (``Mask.layout_key``) passes once per shape: a decode step would
        otherwise classify it in every layer of every token."""
        if type(mask) is CausalMask:  # within itself by definition
            return
        if mask is None:
            if nq > 1:
                raise ValueError("weighting='stick_breaking' breaks the stick over the keys "
                                 "before each query: pass mask=qkv.causal() (or a mask within "
                                 "it); with no mask, queries would see later keys")
            return
        key = mask.layout_key()
        key = None if key is None else (key, batch, heads, nq, nk)
        if key is not None and _IN_ORDER.get(key):
            return
        later = mask & ~causal()
        block = 128
        states = later.tile_states(batch, heads, nq, nk, block, block, device)
        found = bool((states == FULL).any())
        for qi, kj in (states != EMPTY).any(1).any(0).nonzero().tolist() if not found else ():
            q0, k0 = qi * block, kj * block
            q = torch.arange(q0, min(nq, q0 + block), device=device).view(1, 1, -1, 1)
            k = torch.arange(k0, min(nk, k0 + block), device=device).view(1, 1, 1, -1)
            b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
            h = torch.arange(heads, device=device).view(1, -1, 1, 1)
            if bool(torch.as_tensor(later.mask_mod(b, h, q, k, nk - nq)).any()):
                found = True
                break
        if found:
            raise ValueError(f"weighting='stick_breaking' breaks the stick over the keys "
                             f"before each query, but the mask {mask!r} lets a query see a "
                             f"later key: combine it with qkv.causal()")
        if key is not None:
            _IN_ORDER.keep(key, True)

    def weights(self, s, allowed, pos_q, kv_idx, heads=None):
        keep = allowed & self.in_order(pos_q, kv_idx)
        safe = _safe(s, keep)
        # log(1 - β) = -softplus(s); the stick left before key j is exp(-Σ_{l>j} softplus).
        spent = _zero_masked(F.softplus(safe), keep)
        after = spent.flip(-1).cumsum(-1).flip(-1) - spent
        return _zero_masked(torch.exp(F.logsigmoid(safe) - after), keep)

    def __repr__(self):
        return f"stick_breaking(include_self={self.include_self})"


# -- constructors and names --------------------------------------------------------------------
def softmax() -> Weighting:
    return Softmax()


def sigmoid(bias=None) -> Weighting:
    return Sigmoid(bias)


def softpick(eps: float = 1e-6) -> Weighting:
    return Softpick(eps)


def stick_breaking(include_self: bool = False) -> Weighting:
    return StickBreaking(include_self)


def relu(length: int | None = None) -> Weighting:
    return Relu(length)


def identity() -> Weighting:
    return Identity()


def elementwise(fn: Callable) -> Weighting:
    return UserElementwise(fn)


WEIGHTINGS: dict[str, Callable[[], Weighting]] = {
    "softmax": Softmax, "sigmoid": Sigmoid, "softpick": Softpick,
    "stick_breaking": StickBreaking, "relu": Relu, "identity": Identity,
}
SOFTMAX = Softmax()


def as_weighting(weighting) -> Weighting:
    """A name in ``WEIGHTINGS`` or a ``Weighting`` -> the ``Weighting``."""
    if isinstance(weighting, Weighting):
        return weighting
    if isinstance(weighting, str):
        if weighting == "softmax":
            return SOFTMAX
        if weighting in WEIGHTINGS:
            return WEIGHTINGS[weighting]()
        raise ValueError(f"weighting must be one of {sorted(WEIGHTINGS)} or an object from "
                         f"qkv.weighting; got {weighting!r}")
    raise TypeError(f"weighting must be a name ({', '.join(sorted(WEIGHTINGS))}) or an object "
                    f"from qkv.weighting; got {type(weighting).__name__}")


__all__ = ["WEIGHTINGS", "Carry", "Weighting", "as_weighting", "elementwise", "identity",
           "relu", "sigmoid", "softmax", "softpick", "stick_breaking"]
