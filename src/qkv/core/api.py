"""``qkv.attention``: the one entry point, validated and dispatched to the best engine."""

from __future__ import annotations

import torch
from torch import Tensor

from . import engines
from .problem import build_problem
from .result import Result
from .similarity import Similarity


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask=None,
    score_mod=None,
    similarity: str | Similarity = "dot",
    scale=None,
    dropout_p: float = 0.0,
    return_weights: bool = False,
    return_lse: bool = False,
    sinks: Tensor | None = None,
    metric: Tensor | None = None,
    backend: str = "auto",
    fp32_precision: str = "ieee",
):
    """Attention softmax(score(q, k)) v with masks, score modifiers and pluggable similarity.

    Args:
        q: (B, H, Nq, D) queries.
        k: (B, Hkv, Nk, D) keys; H must be a multiple of Hkv (grouped / multi-query heads).
        v: (B, Hkv, Nk, Dv) values.
        mask: None, a bool tensor broadcastable to (B, H, Nq, Nk) (True = may attend), or a
            qkv mask object (``qkv.causal()``, ``qkv.padding(...)``, ... combined with & and |).
        score_mod: None, a callable ``score_mod(score, b, h, q_idx, kv_idx)``, a built-in
            modifier (``qkv.alibi``, ``qkv.relative_bias``, ``qkv.softcap``) or a list of them.
        similarity: "dot" | "cosine" | "l2" | "l1" | "mahalanobis", a name registered with
            ``qkv.register_similarity``, or a ``qkv.Similarity`` (a user's per-dimension term).
        scale: multiplies the similarity; a float or a tensor of shape () or (H,). Default
            1/√D, except cosine: √D.
        dropout_p: dropout on the attention weights (applied whenever > 0; modules pass 0 in eval).
        return_weights: also return the weights (B, H, Nq, Nk) that multiplied v.
        return_lse: also return the log-sum-exp (B, H, Nq) of each softmax row (natural log,
            float32, float64 for float64 inputs; -inf on a row with no allowed key), as
            FlexAttention does. It is differentiable: merging partial results (context
            parallelism) or sinks written in torch get exact gradients.
        sinks: (H,) one learned logit per head, added to every softmax row's denominator
            (attention sinks: GPT-OSS, StreamingLLM); the weights then sum to less than 1.
            Gradients reach it.
        metric: L of shape (D, D) or (H, D, D), for similarity="mahalanobis" (-‖L(q-k)‖²).
        backend: "auto" (fastest engine that can run the request), or force one by name.
        fp32_precision: "ieee" (default), or "bf16": float32 q, k, v and the softmax weights
            may be rounded to bf16 for the two products (scores, softmax and sums stay
            float32), as ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` allows for
            torch's products. The "flash" CPU engine (plain or causal dot products, no
            gradients, AMD CPUs with AVX512-BF16) then multiplies in bf16; other engines
            keep float32.

    Returns:
        out (B, H, Nq, Dv); with return_weights and/or return_lse, the tuple (out, weights,
        lse) without the ones not asked for. Rows with no allowed key give zeros.

    NaN or inf in q or k is not checked (that would cost a pass over the inputs). The output
    rows whose scores read one come out wrong, silently: a bad key makes NaN every row that
    may attend it; a bad query makes its own row NaN, or zeros where torch's SDPA runs the
    call. Other rows are unaffected. Check with ``torch.isfinite`` where inputs may hold
    them; ``qkv train`` stops at the first non-finite loss.
    """
    problem = build_problem(
        q,
        k,
        v,
        mask=mask,
        score_mod=score_mod,
        similarity=similarity,
        scale=scale,
        metric=metric,
        dropout_p=dropout_p,
        return_weights=return_weights,
        needs_lse=return_lse or sinks is not None,
        fp32_precision=fp32_precision,
    )
    if sinks is not None:
        check_sinks(sinks, problem.heads)
    result = engines.plan(problem, backend).run()
    if sinks is None and not (return_weights or return_lse):
        return result.out
    out, lse, weights = result.out, result.lse, result.weights
    if sinks is not None:
        out, lse, weights = with_sinks(out, lse, weights, sinks)
    extra = ([weights] if return_weights else []) + ([lse] if return_lse else [])
    return (out, *extra) if extra else out


def attention_result(q: Tensor, k: Tensor, v: Tensor, *, backend: str = "auto",
                     **kwargs) -> Result:
    """The whole ``Result`` of the engine the dispatcher picks for ``attention(q, k, v,
    **kwargs)``, unchanged: lse is there when that engine has one (the fused engines), None
    from SDPA. Capture tools use it to rebuild chosen heads' weights without moving the call
    off its engine (``return_lse=True`` would)."""
    return engines.plan(build_problem(q, k, v, **kwargs), backend).run()


def check_sinks(sinks, heads: int) -> None:
    if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
        raise TypeError(f"sinks must be a floating-point tensor of shape (H,); got "
                        f"{type(sinks).__name__}")
    if tuple(sinks.shape) != (heads,):
        raise ValueError(f"sinks must have shape (H,)=({heads},); got {tuple(sinks.shape)}")


def with_sinks(out: Tensor, lse: Tensor, weights: Tensor | None, sinks: Tensor):
    """Add exp(sinks[h]) to each row's denominator: out and weights shrink by
    σ(lse - sink) = exp(lse - lse'), with lse' = logaddexp(lse, sink). A row with no allowed
    key keeps out 0 and gets lse' = sink. Plain torch, so gradients reach the sinks."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new_lse = torch.logaddexp(lse, sink)
    keep = torch.sigmoid(lse - sink)
    out = (out * keep.unsqueeze(-1).to(out.dtype))
    if weights is not None:
        weights = weights * keep.unsqueeze(-1).to(weights.dtype)
    return out, new_lse, weights
