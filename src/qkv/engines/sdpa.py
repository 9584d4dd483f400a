"""torch's scaled_dot_product_attention, for the cases it computes exactly as qkv defines them:
the plain dot product with no mask, causal attention (bottom-right with Nq <= Nk, or
top-left), or a dense bool mask and/or an additive float mask (SDPA's own ``attn_mask``) that
leave every row a key (SDPA's answer for an empty row depends on its version and kernel,
qkv's is zeros); on CUDA also cosine,
the dot product of unit vectors, computed on those features (which run under torch autograd,
as in every engine). There, SDPA's kernels are faster than qkv's Triton kernels on the same
features (docs/performance.md, "GPU: variants vs FlexAttention"). On CPU the fused engine is
as fast as SDPA on them (docs/performance.md, "CPU: fused engine vs SDPA"), so cosine stays
there."""

from __future__ import annotations

import torch.nn.functional as F

from ..core.masks import CausalMask, TensorMask
from ..core.masks.rules import TopLeftCausalMask
from ..core.problem import Problem
from ..core.result import Result
from ..core.scores import AdditiveBias
from ..core.similarity import BUILTIN
from ..core.structure import values_readable

# enable_gqa arrived in torch 2.5; older versions get the heads repeated.
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
_DOT, _COSINE = BUILTIN["dot"], BUILTIN["cosine"]
# SDPA's float attn_mask is exactly qkv's additive bias (applied after the scale).
_DENSE_MODS = (AdditiveBias,)


def why_not(p: Problem) -> str | None:
    if not p.weighting.is_softmax:
        return f"SDPA computes softmax only, not the weighting {p.weighting!r}"
    if p.needs_lse:
        return "SDPA does not return the log-sum-exp (return_lse, sinks)"
    if p.similarity is _COSINE and not p.q.is_cuda:
        return "SDPA runs cosine on CUDA only: on CPU the fused engine is faster"
    if p.similarity is not _DOT and p.similarity is not _COSINE:
        return f"SDPA computes only the dot product, not similarity={p.similarity.name!r}"
    if p.score_mod is not None and not isinstance(p.score_mod, _DENSE_MODS):
        return "SDPA has no score_mod (only an additive float mask)"
    if p.return_weights:
        return "SDPA cannot return attention weights"
    if p.metric is not None or not isinstance(p.scale, float):
        return "SDPA needs a plain float scale"
    if p.mask is None or isinstance(p.mask, TopLeftCausalMask):
        return None
    if p.is_causal_only and p.score_mod is None:
        if p.nq > p.nk:
            return "causal with Nq > Nk leaves rows with no key, which SDPA turns into NaN"
        return None
    if not isinstance(p.mask, TensorMask) and p.score_mod is None:
        return "SDPA runs only no mask, a causal one or a dense tensor (the fused engines skip " \
               "the empty tiles of structured masks)"
    if not isinstance(p.mask, (TensorMask, CausalMask, TopLeftCausalMask)):
        return "SDPA adds a float mask only to no mask, a causal one or a dense tensor"
    if not values_readable():
        return "SDPA needs the mask's values, unknown while torch.compile traces"
    return None


def plan(p: Problem):
    """The runner, or the reason SDPA cannot run ``p``. A dense mask, or any mask under an
    additive bias, is materialized once, here: to see that it leaves every row a key, and as
    the mask SDPA receives."""
    reason = why_not(p)
    if reason is not None:
        return reason
    allowed = _allowed(p)
    # A causal mask without a bias leaves no row empty (why_not checked Nq <= Nk).
    if (allowed is not None and not (p.is_causal_only and p.score_mod is None)
            and not bool(allowed.any(-1).all())):
        return "the mask leaves rows with no key, which SDPA turns into NaN"
    return lambda: run(p, allowed)


def _spelled_causal(p: Problem) -> bool:
    """Whether SDPA's ``is_causal=True`` (aligned top-left) is ``p``'s mask: a top-left causal
    mask, or qkv's bottom-right causal one when Nq = Nk, with no bias."""
    return p.score_mod is None and (isinstance(p.mask, TopLeftCausalMask)
                                    or (p.is_causal_only and p.nq == p.nk))


def _allowed(p: Problem):
    """The mask as the bool tensor SDPA receives, or None where it receives none: no mask, a
    causal mask it spells ``is_causal=True``, or a decode step's causal mask (one query,
    aligned bottom-right, sees every key), which would cost a (B, H, 1, Nk) mask built and
    read in each layer of each token (docs/performance.md, "CPU: host time")."""
    if p.mask is None or _spelled_causal(p) or (p.is_causal_only and p.nq == 1):
        return None
    return p.mask.materialize(p.batch, p.heads, p.nq, p.nk, p.q.device)


def _attn_mask(p: Problem, allowed):
    """SDPA's (attn_mask, is_causal) for the mask (``allowed``, from ``_allowed``) and the
    additive bias of ``p``."""
    if p.score_mod is None:
        return (allowed, False) if allowed is not None else (None, _spelled_causal(p))
    bias = p.score_mod.bias.to(p.q.dtype)
    return (bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))), False


def run(p: Problem, allowed=None) -> Result:
    """SDPA on ``p``; ``allowed``: its mask as ``plan`` materialized it (None: made here)."""
    if allowed is None:
        allowed = _allowed(p)
    q, k, v = p.q, p.k, p.v
    if p.similarity is _COSINE:  # the dot product of unit vectors
        q, k = p.similarity.features(q, k, p.metric)
    gqa = k.shape[1] != q.shape[1]
    if gqa and not _HAS_GQA:
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False
    attn_mask, is_causal = _attn_mask(p, allowed)
    if gqa:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, p.dropout_p, is_causal,
                                             scale=p.scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, p.dropout_p, is_causal,
                                             scale=p.scale)
    return Result(out)
