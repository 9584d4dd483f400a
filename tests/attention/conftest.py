"""Shared helpers for the attention tests."""

import pytest
import torch

import qkv


def rand_qkv(
    b=2, h=4, hkv=2, nq=5, nk=7, d=6, dv=3, dtype=torch.float64, requires_grad=False, seed=0
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, nk, dv, generator=g, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def mask_cases(b, nq, nk):
    """One instance of every mask kind for a (b, ., nq, nk) problem, including fully masked rows."""
    g = torch.Generator().manual_seed(1)
    dense = torch.rand(b, 1, nq, nk, generator=g) > 0.4
    dense[0, 0, 0] = False  # a row with no allowed key
    edges = torch.stack(
        [torch.randint(0, nk, (3 * nq,), generator=g), torch.randint(0, nq, (3 * nq,), generator=g)]
    )
    adjacency = torch.rand(nq, nk, generator=g) > 0.6
    q_ids = torch.tensor([[0] * (nq // 2) + [1] * (nq - nq // 2)] * b)
    kv_ids = torch.tensor([[0] * (nk // 3) + [1] * (nk - nk // 3)] * b)
    return {
        "none": None,
        "causal": qkv.causal(),
        "sliding": qkv.sliding_window(2, 1),
        "padding": qkv.padding(torch.tensor([nk, 0] + [nk - 1] * (b - 2))[:b]),
        "segments": qkv.segments(q_ids, kv_ids),
        "graph_edges": qkv.graph(edges),
        "graph_adjacency": qkv.graph(adjacency),
        "bool_tensor": dense,
        "combined": (qkv.causal() | qkv.sliding_window(0, 2))
        & qkv.padding(torch.tensor([nk - 2] * b)),
    }


@pytest.fixture
def qkv_f64():
    return rand_qkv()


@pytest.fixture
def one_thread():
    """Tiny tiles are many tiny ops; on a shared 2-core machine one thread runs them fastest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
