"""``Carry.NONE``: weightings of one score at a time (sigmoid, relu, identity, a user's
function), each its function as a score modifier the engines trace."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..scores import ScoreMod, captured_tensors
from ..structure import values_readable
from .base import Carry, Weighting, zero_masked


class Elementwise(Weighting):
    """w = f(s): ``score_fn(nk)`` is f as a score modifier, which the engines trace."""

    carry = Carry.NONE

    def score_fn(self, nk: int) -> ScoreMod | None:
        """f for a call with ``nk`` keys, as a ``ScoreMod`` (None: f(s) = s)."""
        raise NotImplementedError

    def weights(self, s, allowed, pos_q, kv_idx, heads=None):
        fn = self.score_fn(s.shape[-1])
        safe = zero_masked(s, allowed)
        if fn is None:
            return zero_masked(safe, allowed)
        b = torch.arange(s.shape[0], device=s.device).view(-1, 1, 1, 1)
        h = torch.arange(s.shape[1], device=s.device).view(1, -1, 1, 1) if heads is None \
            else heads
        w = fn(safe, b, h, pos_q.view(1, 1, -1, 1), kv_idx.view(1, 1, 1, -1))
        return zero_masked(w.expand(s.shape).to(s.dtype), allowed)


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
