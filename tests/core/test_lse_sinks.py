"""``return_lse`` and ``sinks`` on every CPU engine, against float64 written out by hand."""

import pytest
import torch

import qkv

ENGINES = ["reference", "fused"]


def _inputs(h=4, hkv=2, nq=13, nk=17, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, heads, n, d, generator=g, dtype=torch.float64).requires_grad_()
            for heads, n in ((h, nq), (hkv, nk), (hkv, nk))]


def _by_hand(q, k, v, mask, sinks=None):
    """Materialized float64: lse over the allowed keys, and the sink in the denominator."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.view(1, -1, 1))
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return weights @ v, lse


@pytest.mark.parametrize("backend", ENGINES)
def test_lse_matches_float64_and_is_differentiable(backend):
    q, k, v = _inputs()
    mask = qkv.causal() & qkv.padding([17, 9])
    out, lse = qkv.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
    dense = mask.materialize(2, 4, 13, 17)
    ref_out, ref_lse = _by_hand(q, k, v, dense)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    weight = torch.randn(lse.shape, dtype=torch.float64)
    grads = torch.autograd.grad((out.sum() + (lse * weight).sum()), (q, k, v))
    ref = torch.autograd.grad((ref_out.sum() + (ref_lse * weight).sum()), (q, k, v))
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_rows_without_keys_give_minus_inf_lse_and_no_nan_gradient():
    q, k, v = _inputs(nq=6, nk=3)
    for backend in ENGINES:
        out, lse = qkv.attention(q, k, v, mask=qkv.causal(), return_lse=True, backend=backend)
        assert torch.isneginf(lse[:, :, :3]).all() and torch.isfinite(lse[:, :, 3:]).all()
        finite = torch.where(torch.isfinite(lse), lse, 0.0)
        grads = torch.autograd.grad(out.sum() + finite.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() for g in grads)


def test_the_graph_engine_returns_a_differentiable_lse():
    n = 200  # a ring with one chord per node: sparse enough for the gather path
    q, k, v = _inputs(h=2, hkv=2, nq=n, nk=n)
    edges = torch.tensor([[i, j] for i in range(n) for j in {i, (i + 1) % n, (i * 7) % n}])
    mask = qkv.graph(edges.T, num_nodes=n)
    weight = torch.randn(2, 2, n, dtype=torch.float64)
    grads = []
    for backend in ("graph", "reference"):
        out, lse = qkv.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
        grads.append(torch.autograd.grad(out.sum() + (lse * weight).sum(), (q, k, v)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", ENGINES)
def test_sinks_match_float64_with_gradients(backend):
    q, k, v = _inputs()
    sinks = torch.randn(4, dtype=torch.float64).requires_grad_()
    mask = qkv.causal() & qkv.padding([17, 0])  # batch 1 has no key: its rows stay 0
    out, lse = qkv.attention(q, k, v, mask=mask, sinks=sinks, return_lse=True, backend=backend)
    ref_out, ref_lse = _by_hand(q, k, v, mask.materialize(2, 4, 13, 17), sinks)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)
    assert (out[1] == 0).all()
    grads = torch.autograd.grad(out.square().sum(), (q, k, v, sinks))
    ref = torch.autograd.grad(ref_out.square().sum(), (q, k, v, sinks))
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b)


def test_sinks_shrink_the_returned_weights_alike():
    q, k, v = (t.detach() for t in _inputs())
    sinks = torch.zeros(4, dtype=torch.float64)
    out, weights = qkv.attention(q, k, v, sinks=sinks, return_weights=True)
    assert (weights.sum(-1) < 1).all()
    torch.testing.assert_close(out, weights @ v.repeat_interleave(2, 1))


@pytest.mark.parametrize(("sinks", "message"), [
    (torch.zeros(3), r"sinks must have shape \(H,\)=\(4,\)"),
    (torch.zeros(4, dtype=torch.long), "sinks must be a floating-point tensor"),
    ([0.0] * 4, "sinks must be a floating-point tensor"),
])
def test_bad_sinks_are_named(sinks, message):
    q, k, v = (t.detach() for t in _inputs())
    with pytest.raises((TypeError, ValueError), match=message):
        qkv.attention(q, k, v, sinks=sinks)
