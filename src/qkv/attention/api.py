"""``qkv.attention``: the one entry point, validated and dispatched to the best engine."""

from __future__ import annotations

from torch import Tensor

from . import engines
from .problem import build_problem
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
    metric: Tensor | None = None,
    backend: str = "auto",
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
        metric: L of shape (D, D) or (H, D, D), for similarity="mahalanobis" (-‖L(q-k)‖²).
        backend: "auto" (fastest engine that can run the request), or force one by name.

    Returns:
        out (B, H, Nq, Dv), or (out, weights). Rows with no allowed key give zeros.

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
    )
    return engines.select(problem, backend).run(problem)


def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, **kwargs):
    """``attention(q, k, v, **kwargs)`` and the log-sum-exp (B, H, Nq, 1) of its softmax rows
    when the engine that ran it saved one (the fused engines do), else None. Capture tools use
    it to rebuild chosen heads' weights as exp(score - lse) without another pass over keys."""
    backend = kwargs.pop("backend", "auto")
    problem = build_problem(q, k, v, **kwargs)
    problem.lse_sink = []
    result = engines.select(problem, backend).run(problem)
    return result, (problem.lse_sink[0] if problem.lse_sink else None)
