"""The variants every context-parallel test runs, and the per-rank comparison with one process.

Each variant is built the same way on every rank (a fixed seed), so a rank can run the whole
sequence through ``qkv.attention`` in one process and compare its own shard."""

from __future__ import annotations

import torch

import qkv
from qkv.core.scores import alibi_slopes
from qkv.distributed import context_parallel_attention, shard

B, H, HKV, D = 2, 4, 2, 8


def variants(n: int) -> dict:
    """name -> (kwargs for attention, learnable tensors besides q, k, v)."""
    g = torch.Generator().manual_seed(7)
    slopes = torch.nn.Parameter(alibi_slopes(H))
    w = torch.nn.Parameter(torch.rand(D, generator=g) + 0.5)
    sinks = torch.nn.Parameter(torch.randn(H, generator=g))
    ids = torch.randint(0, 3, (n,), generator=g).sort().values
    edges = torch.randint(0, n, (2, 6 * n), generator=g)
    weighted_l1 = qkv.Similarity(lambda q, k: -w * (q - k).abs(), name="weighted_l1")
    return {
        "causal_dot": ({"mask": qkv.causal()}, []),
        "causal_l1_alibi": ({"mask": qkv.causal(), "similarity": "l1",
                             "score_mod": qkv.alibi(slopes=slopes)}, [slopes]),
        "segments": ({"mask": qkv.segments(ids)}, []),
        "sliding_window": ({"mask": qkv.sliding_window(n // 5)}, []),
        "graph": ({"mask": qkv.graph(edges, num_nodes=n)}, []),
        "user_similarity": ({"mask": qkv.causal(), "similarity": weighted_l1}, [w]),
        "sinks": ({"mask": qkv.causal(), "sinks": sinks}, [sinks]),
    }


def relative(x, ref) -> float:
    return float((x - ref).norm() / ref.norm().clamp(min=1e-30))


def compare(rank: int, world: int, layout: str, n: int, names: list[str],
            rows: int | None = None) -> dict:
    """name -> (out error, worst gradient error) of this rank against one process, each
    ‖x - ref‖ / ‖ref‖ (the gradients: of q, k, v shards and every learnable tensor).
    ``rows``: the ring's query rows per call and key/value rows per piece, when not its own."""
    if rows is not None:
        from qkv.distributed import ring

        ring.QUERY_ROWS = ring.KV_ROWS = rows
    errors = {}
    for name in names:
        kwargs, extras = variants(n)[name]
        g = torch.Generator().manual_seed(1)
        q, grad_out = (torch.randn(B, H, n, D, generator=g) for _ in range(2))
        k, v = (torch.randn(B, HKV, n, D, generator=g) for _ in range(2))
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


def disagree(rank: int, world: int, cases: list[str]) -> dict:
    """case -> the error this rank gets when the ranks ask for different things ("" if none)."""
    return {case: _error(rank, case) for case in cases}


def _error(rank: int, case: str) -> str:
    n, kwargs = 6, {"mask": qkv.causal()}
    if case == "shapes" and rank == 1:
        n = 8  # what an uneven split of the sequence leaves
    if case == "variant" and rank == 1:
        kwargs["similarity"] = "l1"
    if case == "invalid" and rank == 1:
        kwargs["mask"] = qkv.segments(torch.zeros(5, dtype=torch.long))
    q, k, v = (torch.randn(1, 2, n, 4) for _ in range(3))
    try:
        context_parallel_attention(q, k, v, **kwargs)
    except ValueError as e:
        return str(e)
    return ""
