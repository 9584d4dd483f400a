"""The weightings the context-parallel tests run in float64, each against one process's
``qkv.attention(..., weighting=...)``, and the ones the ring refuses."""

from __future__ import annotations

import torch

import qkv
from qkv.core.scores import alibi_slopes
from qkv.distributed import context_parallel_attention, shard
from qkv.weighting import Normalized

from .cases import relative

B, H, HKV, D = 2, 4, 2, 8
F64 = torch.float64


def _soft_relu(s):
    return torch.nn.functional.softplus(s) * 0.1


def variants(n: int) -> dict:
    """name -> (kwargs for attention, learnable tensors besides q, k, v)."""
    g = torch.Generator().manual_seed(5)
    bias = torch.nn.Parameter(torch.randn(H, generator=g, dtype=F64) - 2)
    slopes = torch.nn.Parameter(alibi_slopes(H).to(F64))
    ids = torch.randint(0, 3, (n,), generator=g).sort().values
    causal, w = qkv.causal(), qkv.weighting
    return {
        "sigmoid": ({"mask": causal, "weighting": "sigmoid"}, []),
        "sigmoid_bias": ({"mask": causal, "weighting": w.sigmoid(bias)}, [bias]),
        "relu_window": ({"mask": qkv.sliding_window(n // 5), "weighting": "relu"}, []),
        "identity_cosine": ({"similarity": "cosine", "scale": 1.0, "weighting": "identity"}, []),
        "elementwise_alibi": ({"mask": causal, "score_mod": qkv.alibi(slopes=slopes),
                               "weighting": w.elementwise(_soft_relu)}, [slopes]),
        "softpick": ({"mask": causal, "weighting": "softpick"}, []),
        "softpick_segments_alibi": ({"mask": qkv.segments(ids), "weighting": w.softpick(1e-2),
                                     "score_mod": qkv.alibi(slopes=slopes)}, [slopes]),
        # Scores up to about ±30: e^s far from 1, and rows whose scores are all below 0.
        "softpick_wide": ({"mask": causal, "scale": 4.0, "weighting": "softpick"}, []),
        "stick": ({"mask": causal, "weighting": "stick_breaking"}, []),
        "stick_self_window_alibi": ({"mask": causal & qkv.sliding_window(n // 3),
                                     "score_mod": qkv.alibi(slopes=slopes),
                                     "weighting": w.stick_breaking(include_self=True)}, [slopes]),
    }


def compare(rank: int, world: int, layout: str, n: int, names: list[str],
            rows: int | None = None) -> dict:
    """name -> (out error, worst gradient error) of this rank against one process in float64
    (gradients of the q, k, v shards and every learnable tensor); ``rows`` as in
    ``cases.compare``."""
    if rows is not None:
        from qkv.distributed import ring

        ring.QUERY_ROWS = ring.KV_ROWS = rows
    errors = {}
    for name in names:
        kwargs, extras = variants(n)[name]
        g = torch.Generator().manual_seed(2)
        q, grad_out = (torch.randn(B, H, n, D, generator=g, dtype=F64) for _ in range(2))
        k, v = (torch.randn(B, HKV, n, D, generator=g, dtype=F64) for _ in range(2))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = qkv.attention(*whole, **kwargs)
        ref_grads = torch.autograd.grad((ref * grad_out).sum(), whole + extras)
        local = [shard(t, rank, world, layout).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, layout=layout, **kwargs)
        grads = torch.autograd.grad((out * shard(grad_out, rank, world, layout)).sum(),
                                    local + extras)
        ref_local = [shard(t, rank, world, layout) for t in ref_grads[:3]] + list(ref_grads[3:])
        errors[name] = (
            relative(out.detach(), shard(ref.detach(), rank, world, layout)),
            max(relative(a, b) for a, b in zip(grads, ref_local, strict=True)),
        )
    return errors


class _Halved(Normalized):
    """A MAX_SUM weighting of a user's own, which the ring has no rule for."""

    name = "halved"

    def terms(self, s, m):
        e = torch.exp(s - m)
        return e / 2, e

    def slopes(self, s):
        return 1.0, 1.0


def refused(rank: int, world: int, cases: list[str]) -> dict:
    """case -> the error this rank gets ("" if none)."""
    found = {}
    for case in cases:
        kwargs = {
            "user_max_sum": {"mask": qkv.causal(), "weighting": _Halved()},
            "sinks": {"mask": qkv.causal(), "weighting": "sigmoid", "sinks": torch.zeros(2)},
            "stick_unmasked": {"weighting": "stick_breaking"},
            "stick_window": {"mask": qkv.sliding_window(2, 2), "weighting": "stick_breaking"},
            "bias_heads": {"weighting": qkv.weighting.sigmoid(torch.zeros(3))},
        }[case]
        q, k, v = (torch.randn(1, 2, 6, 4) for _ in range(3))
        try:
            context_parallel_attention(q, k, v, **kwargs)
            found[case] = ""
        except ValueError as e:
            found[case] = str(e)
    return found
