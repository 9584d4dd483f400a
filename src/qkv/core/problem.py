"""One attention call, validated and normalized, as every engine receives it."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .masks import CausalMask, Mask, as_mask
from .scores import ScoreMod, as_score_mod
from .similarity import Similarity, get_similarity
from .structure import values_readable
from .weighting import SOFTMAX, Carry, Weighting, as_weighting

_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
FP32_PRECISIONS = ("ieee", "bf16")


class Problem(NamedTuple):
    """q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), plus the variant: the request
    every engine plans from. Immutable: engines read it and never write into it. (A named
    tuple rather than a frozen dataclass: every call builds one, and this is 5x cheaper.)

    ``scale`` is a float, or a tensor of shape () or (H,) (a learnable temperature).
    ``needs_lse``: the caller reads the log-sum-exp (``return_lse``, sinks), so an engine
    that cannot return a differentiable one must decline. ``fp32_precision``: "ieee", or
    "bf16" where float32 inputs may have their products rounded to bf16. ``weighting``: how
    scores become weights (``core.weighting``), softmax by default."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Mask | None
    score_mod: ScoreMod | None
    similarity: Similarity
    scale: float | Tensor
    metric: Tensor | None
    dropout_p: float
    return_weights: bool
    needs_lse: bool = False
    fp32_precision: str = "ieee"
    weighting: Weighting = SOFTMAX

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def nq(self) -> int:
        return self.q.shape[2]

    @property
    def nk(self) -> int:
        return self.k.shape[2]

    @property
    def offset(self) -> int:
        """Nk - Nq: query i sits at key position i + offset (bottom-right alignment)."""
        return self.nk - self.nq

    @property
    def is_causal_only(self) -> bool:
        return isinstance(self.mask, CausalMask)

    def scale_tensor(self) -> float | Tensor:
        """The scale, broadcastable to (B, H, Nq, Nk)."""
        if isinstance(self.scale, Tensor) and self.scale.dim() == 1:
            return self.scale.view(1, -1, 1, 1)
        return self.scale

    def grad_tensors(self) -> tuple[Tensor, ...]:
        """Every tensor besides q, k, v that a gradient may have to reach."""
        extra: list[Tensor] = []
        if self.metric is not None:
            extra.append(self.metric)
        if isinstance(self.scale, Tensor):
            extra.append(self.scale)
        extra.extend(self.similarity.tensors())
        extra.extend(self.weighting.tensors())
        if self.score_mod is not None:
            extra.extend(self.score_mod.tensors())
        return tuple(t for t in extra if t.is_floating_point())


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def _valid_qkv(q, k, v) -> bool:
    """The common case in one expression: every call pays for it, so it stays cheap."""
    try:
        qs, ks, vs = q.shape, k.shape, v.shape
        return (len(qs) == len(ks) == len(vs) == 4 and q.dtype == k.dtype == v.dtype
                and q.dtype in _FLOAT_DTYPES and ks[:3] == vs[:3] and qs[0] == ks[0]
                and qs[3] == ks[3] and qs[3] > 0 and ks[1] > 0 and qs[1] % ks[1] == 0
                and q.device == k.device == v.device)
    except AttributeError:
        return False


def _check_qkv(q, k, v) -> None:
    if _valid_qkv(q, k, v):
        return
    for name, t, layout in (
        ("q", q, "(B, H, Nq, D)"),
        ("k", k, "(B, Hkv, Nk, D)"),
        ("v", v, "(B, Hkv, Nk, Dv)"),
    ):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor {layout}, or q, k and v all 3-D "
                             f"(unbatched); got shape {_shape(t)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float64, float32, bfloat16 or float16; got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device; got {q.device}, {k.device}, {v.device}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k (B, Hkv, Nk, D) and v (B, Hkv, Nk, Dv) must agree on B, Hkv and Nk; got k "
            f"{_shape(k)} and v {_shape(v)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"q and k must have the same batch size B; got q {_shape(q)}, k {_shape(k)}"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q and k must have the same head dim D; got q {_shape(q)} and k {_shape(k)}"
        )
    if q.shape[3] == 0:
        raise ValueError(f"the head dim D of q and k must be at least 1; got q {_shape(q)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"the number of query heads H={q.shape[1]} must be a multiple of the number of "
            f"key/value heads Hkv={k.shape[1]}"
        )


def _check_metric(metric, similarity: Similarity, q: Tensor):
    if not similarity.needs_metric:
        if metric is not None:
            raise ValueError(
                f"metric is only used with similarity='mahalanobis', not {similarity.name!r}"
            )
        return None
    d, h = q.shape[3], q.shape[1]
    if metric is None:
        raise ValueError(
            f"similarity='mahalanobis' needs metric=L of shape (D, D) or (H, D, D), D={d}"
        )
    if not isinstance(metric, Tensor) or not metric.is_floating_point():
        raise TypeError("metric must be a floating-point tensor of shape (D, D) or (H, D, D)")
    if metric.shape not in ((d, d), (h, d, d)):
        raise ValueError(
            f"metric must have shape (D, D)=({d}, {d}) or (H, D, D)=({h}, {d}, {d}); got "
            f"{_shape(metric)}"
        )
    return metric


def _check_scale(scale, similarity: Similarity, q: Tensor):
    if scale is None:
        return similarity.default_scale(q.shape[-1])
    if isinstance(scale, Tensor):
        if scale.dim() > 1 or (scale.dim() == 1 and scale.numel() != q.shape[1]):
            raise ValueError(
                f"scale tensor must have shape () or (H,)=({q.shape[1]},); got {_shape(scale)}"
            )
        return scale
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or (values_readable() and not math.isfinite(scale))):
        raise TypeError(
            f"scale must be a finite number or a tensor of shape () or (H,); got {scale!r}"
        )
    return float(scale)


def build_problem(
    q, k, v, *, mask=None, score_mod=None, similarity="dot", scale=None, metric=None,
    dropout_p=0.0, return_weights=False, needs_lse=False, fp32_precision="ieee",
    weighting="softmax", lse_reader="return_lse=True",
) -> Problem:
    """``lse_reader`` names what reads the log-sum-exp when ``needs_lse`` (for the message
    a weighting without one gives)."""
    _check_qkv(q, k, v)
    sim = get_similarity(similarity)
    mask = as_mask(mask)
    batch, heads, nq, _ = q.shape
    if mask is not None:
        mask.check(batch, heads, nq, k.shape[2])
    weighting = as_weighting(weighting)
    weighting.check_heads(heads)
    if needs_lse and not weighting.is_softmax:
        raise ValueError(f"{lse_reader} needs a softmax's log-sum-exp; the weighting "
                         f"{weighting!r} has none")
    if weighting.carry is Carry.STICK and values_readable():
        weighting.check_mask(mask, batch, heads, nq, k.shape[2], q.device)
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be a number in [0, 1); got {dropout_p!r}")
    score_mod = as_score_mod(score_mod)
    if score_mod is not None:
        score_mod.check_heads(heads)
    if fp32_precision not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS}; got "
                         f"{fp32_precision!r}")
    return Problem(
        q=q,
        k=k,
        v=v,
        mask=mask,
        score_mod=score_mod,
        similarity=sim,
        scale=_check_scale(scale, sim, q),
        metric=_check_metric(metric, sim, q),
        dropout_p=float(dropout_p),
        return_weights=bool(return_weights),
        needs_lse=bool(needs_lse),
        fp32_precision=fp32_precision,
        weighting=weighting,
    )
