"""``qkv.attention``: the one entry point, validated and dispatched to the best engine."""

from __future__ import annotations

import inspect

import torch
from torch import Tensor

from .. import engines
from ..core import spellings
from ..core.masks import Mask
from ..core.problem import build_problem
from ..core.result import Result
from ..core.scores import as_score_mod
from ..core.similarity import Similarity


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask=None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    mask=None,
    score_mod=None,
    similarity: str | Similarity = "dot",
    scale=None,
    enable_gqa: bool | None = None,
    block_mask=None,
    return_weights: bool = False,
    return_lse: bool = False,
    sinks: Tensor | None = None,
    metric: Tensor | None = None,
    backend: str = "auto",
    fp32_precision: str = "ieee",
    weighting="softmax",
    **unknown,
):
    """Attention weighting(score(q, k)) v, softmax by default, with masks, score modifiers
    and pluggable similarity.

    The first six arguments are SDPA's, in SDPA's order and with SDPA's meaning, so that
    ``qkv.attention`` is a drop-in for ``F.scaled_dot_product_attention``; ``block_mask`` and
    ``return_lse`` are FlexAttention's. Keywords of those APIs that qkv spells otherwise
    (``need_weights``, ``key_padding_mask``, ...) get one line naming the qkv form.

    Args:
        q: (B, H, Nq, D) queries, or unbatched (H, Nq, D) (then k, v and the results are
            unbatched too).
        k: (B, Hkv, Nk, D) keys; H must be a multiple of Hkv (grouped / multi-query heads).
        v: (B, Hkv, Nk, Dv) values.
        attn_mask: SDPA's mask, broadcastable to (B, H, Nq, Nk): bool (True = may attend) or
            float (added to the scores; -inf blocks). Anything ``mask`` takes works here too;
            given both, both apply.
        dropout_p: dropout on the attention weights (applied whenever > 0; modules pass 0 in
            eval).
        is_causal: SDPA's causal mask, top-left aligned: query i sees keys j <= i. (qkv's
            ``mask=qkv.causal()`` is bottom-right aligned, as a KV cache needs; the two
            agree when Nq == Nk.)
        mask: None, a bool tensor broadcastable to (B, H, Nq, Nk) (True = may attend), a
            float tensor (added to the scores, as SDPA's float ``attn_mask``), a qkv mask
            object (``qkv.causal()``, ``qkv.padding(...)``, ... combined with & and |), a
            FlexAttention ``BlockMask``, or a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``.
        score_mod: None, a callable ``score_mod(score, b, h, q_idx, kv_idx)``, a built-in
            modifier (``qkv.alibi``, ``qkv.relative_bias``, ``qkv.softcap``) or a list of them.
        similarity: "dot" | "cosine" | "l2" | "l1" | "mahalanobis", a name registered with
            ``qkv.register_similarity``, or a ``qkv.Similarity`` (a user's per-dimension term).
        scale: multiplies the similarity; a float or a tensor of shape () or (H,). Default
            1/√D, except cosine: √D.
        enable_gqa: SDPA's: False refuses H != Hkv, as SDPA does; None (default) and True
            group query heads over key/value heads whenever H is a multiple of Hkv.
        block_mask: FlexAttention's ``BlockMask``, with FlexAttention's meaning (its full
            tiles are taken whole, its partial ones masked by its ``mask_mod``).
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
        weighting: how scores become weights: "softmax" (default), "sigmoid", "softpick",
            "stick_breaking", "relu", "identity", or an object from ``qkv.weighting``
            (``sigmoid(bias=...)``, ``stick_breaking(include_self=...)``,
            ``elementwise(fn)``, ...). Only softmax has a log-sum-exp, so the others refuse
            ``return_lse`` and ``sinks``; stick-breaking needs a mask within
            ``qkv.causal()``. Masked keys get weight 0 under every weighting (a float
            ``attn_mask`` is a score bias: -inf there is w(-inf)).

    Returns:
        out (B, H, Nq, Dv); with return_weights and/or return_lse, the tuple (out, weights,
        lse) without the ones not asked for. Rows with no allowed key give zeros.

    NaN or inf in q or k is not checked (that would cost a pass over the inputs). The output
    rows whose scores read one come out wrong, silently: a bad key makes NaN every row that
    may attend it; a bad query makes its own row NaN, or zeros where torch's SDPA runs the
    call. Other rows are unaffected. Check with ``torch.isfinite`` where inputs may hold
    them; ``qkv train`` stops at the first non-finite loss.
    """
    if unknown:
        spellings.reject_keywords(unknown, KEYWORDS)
    # The 4-D call, the common one, pays one attribute read here.
    unbatched = getattr(q, "ndim", 4) == 3 and spellings.unbatch(q, k, v)
    if unbatched:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    problem = _problem(q, k, v, attn_mask, dropout_p, is_causal, mask, score_mod, similarity,
                       scale, enable_gqa, block_mask, return_weights, return_lse, sinks, metric,
                       fp32_precision, weighting)
    if sinks is not None:
        check_sinks(sinks, problem.heads)
    result = engines.plan(problem, backend).run()
    if sinks is None and not (return_weights or return_lse or unbatched):
        return result.out
    out, lse, weights = result.out, result.lse, result.weights
    if sinks is not None:
        out, lse, weights = with_sinks(out, lse, weights, sinks, problem.v)
    extra = ([weights] if return_weights else []) + ([lse] if return_lse else [])
    if unbatched:
        out, extra = out.squeeze(0), [t.squeeze(0) for t in extra]
    return (out, *extra) if extra else out


KEYWORDS = [name for name in inspect.signature(attention).parameters
            if name not in ("q", "k", "v", "unknown")]


def _problem(q, k, v, attn_mask, dropout_p, is_causal, mask, score_mod, similarity, scale,
             enable_gqa, block_mask, return_weights, return_lse, sinks, metric,
             fp32_precision, weighting):
    """``attention``'s arguments (q, k, v batched) validated into the ``Problem``."""
    if not (attn_mask is None and block_mask is None and is_causal is False
            and enable_gqa is None and (mask is None or isinstance(mask, Mask))):
        mask, score_mod = _spelled_mask(q, k, attn_mask, mask, block_mask, is_causal,
                                        enable_gqa, score_mod)
    return build_problem(
        q, k, v, mask=mask, score_mod=score_mod, similarity=similarity, scale=scale,
        metric=metric, dropout_p=dropout_p, return_weights=return_weights,
        needs_lse=return_lse or sinks is not None, fp32_precision=fp32_precision,
        weighting=weighting, lse_reader="sinks" if sinks is not None else "return_lse=True")


def explain(q: Tensor, k: Tensor, v: Tensor, attn_mask=None, dropout_p: float = 0.0,
            is_causal: bool = False, *, backend: str = "auto", **kwargs):
    """Which engine ``attention(q, k, v, ...)`` with the same arguments runs on, and why
    each engine asked before it refused: an ``engines.Explanation`` (``engine``,
    ``refused``), whose ``str`` is one line per engine. Nothing is computed."""
    unknown = {name: value for name, value in kwargs.items() if name not in KEYWORDS}
    if unknown:
        spellings.reject_keywords(unknown, KEYWORDS)
    args = {name: kwargs.get(name, default) for name, default in _EXPLAINED.items()}
    if getattr(q, "ndim", 4) == 3 and spellings.unbatch(q, k, v):
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    problem = _problem(q, k, v, attn_mask, dropout_p, is_causal, **args)
    return engines.explain(problem, backend)


_EXPLAINED = {name: p.default for name, p in inspect.signature(attention).parameters.items()
              if p.kind is p.KEYWORD_ONLY and name != "backend"}


def _spelled_mask(q, k, attn_mask, mask, block_mask, is_causal, enable_gqa, score_mod):
    """SDPA's and FlexAttention's mask spellings -> (a qkv mask, the score modifier with any
    additive bias applied last)."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and q.dim() == k.dim() == 4):
        return mask, score_mod  # build_problem names what is wrong with q, k, v
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    spellings.check_gqa(enable_gqa, q.shape[1], k.shape[1])
    if block_mask is not None and not spellings.is_block_mask(block_mask):
        raise TypeError(f"block_mask must be a FlexAttention BlockMask; got "
                        f"{type(block_mask).__name__}")
    masks, biases = [spellings.sdpa_causal(is_causal, shape[2], shape[3])], []
    for name, value in (("mask", mask), ("attn_mask", attn_mask), ("block_mask", block_mask)):
        found, bias = spellings.split_mask(value, name, shape)
        masks.append(found)
        biases.append(bias)
    mods = [m for m in [as_score_mod(score_mod), *biases] if m is not None]
    return spellings.combine(masks), (mods[0] if len(mods) == 1 else mods or None)


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


def with_sinks(out: Tensor, lse: Tensor, weights: Tensor | None, sinks: Tensor, v: Tensor):
    """Add exp(sinks[h]) to each row's denominator: out and weights shrink by
    σ(lse - sink) = exp(lse - lse'), with lse' = logaddexp(lse, sink). A row with no allowed
    key keeps out 0 and gets lse' = sink. Plain torch, so gradients reach the sinks.

    Weights that need gradients then multiply v (B, Hkv, Nk, Dv) themselves, so that they are
    on the output's graph, as "the weights that multiplied v" are: attribution methods take
    the gradient of the loss with respect to them."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new_lse = torch.logaddexp(lse, sink)
    keep = torch.sigmoid(lse - sink)
    if weights is None:
        return out * keep.unsqueeze(-1).to(out.dtype), new_lse, None
    weights = weights * keep.unsqueeze(-1).to(weights.dtype)
    if not weights.requires_grad:
        return out * keep.unsqueeze(-1).to(out.dtype), new_lse, weights
    group = weights.shape[1] // v.shape[1]
    out = weights.to(v.dtype) @ v.repeat_interleave(group, dim=1)
    return out, new_lse, weights
