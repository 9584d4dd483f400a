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

from collections.abc import Callable

from .base import Carry, Weighting

# The classes are here too, for isinstance and subclassing (qkv.weighting re-exports them).
from .elementwise import Elementwise, Identity, Relu, Sigmoid, UserElementwise  # noqa: F401
from .normalized import Normalized, Softmax, Softpick  # noqa: F401
from .stick import StickBreaking


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
