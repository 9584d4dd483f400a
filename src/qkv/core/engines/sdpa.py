"""torch's scaled_dot_product_attention, for the cases it computes exactly as qkv defines them:
the plain dot product with no mask, or causal attention with Nq <= Nk; on CUDA also cosine,
the dot product of unit vectors, computed on those features (which run under torch autograd,
as in every engine). There, SDPA's kernels were measured faster than qkv's Triton kernels on
the same features (H100, bf16, D = 128, N = 8k: cosine forward+backward 8.66 ms in SDPA's
cuDNN backend, 14.76 ms in Triton; docs/benchmarks.md). On CPU the fused engine is the faster
one (0.90-0.96x SDPA's plain time at N = 4096), so cosine stays there."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..problem import Problem
from ..result import Result
from ..similarity import BUILTIN

# enable_gqa arrived in torch 2.5; older versions get the heads repeated.
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")
_DOT, _COSINE = BUILTIN["dot"], BUILTIN["cosine"]


def why_not(p: Problem) -> str | None:
    if p.needs_lse:
        return "SDPA does not return the log-sum-exp (return_lse, sinks)"
    if p.similarity is _COSINE and not p.q.is_cuda:
        return "SDPA runs cosine on CUDA only: on CPU the fused engine is faster"
    if p.similarity is not _DOT and p.similarity is not _COSINE:
        return f"SDPA computes only the dot product, not similarity={p.similarity.name!r}"
    if p.score_mod is not None:
        return "SDPA has no score_mod"
    if p.return_weights:
        return "SDPA cannot return attention weights"
    if p.metric is not None or not isinstance(p.scale, float):
        return "SDPA needs a plain float scale"
    if p.mask is not None:
        if not p.is_causal_only:
            return "SDPA runs only no mask or qkv.causal()"
        if p.nq > p.nk:
            return "causal with Nq > Nk leaves rows with no key, which SDPA turns into NaN"
    return None


def run(p: Problem) -> Result:
    q, k, v = p.q, p.k, p.v
    if p.similarity is _COSINE:  # the dot product of unit vectors
        q, k = p.similarity.features(q, k, p.metric)
    gqa = k.shape[1] != q.shape[1]
    if gqa and not _HAS_GQA:
        group = q.shape[1] // k.shape[1]
        k, v, gqa = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), False
    attn_mask, is_causal = None, False
    if p.mask is not None:  # causal only (why_not)
        if q.shape[2] == k.shape[2]:
            is_causal = True
        else:  # SDPA's is_causal is top-left aligned; qkv's causal is bottom-right.
            attn_mask = torch.ones(p.nq, p.nk, dtype=torch.bool, device=q.device).tril(p.offset)
    if gqa:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, p.dropout_p, is_causal,
                                             scale=p.scale, enable_gqa=True)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, p.dropout_p, is_causal,
                                             scale=p.scale)
    return Result(out)
