"""Traces kept between calls (``kernelgen.memo``): qkv's own masks and modifiers are traced
once per structure, a hit reads this call's tensors, and a user's callable is traced on
every call (it may read values no key sees)."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.core.scores import Alibi, as_score_mod
from qkv.core.similarity import BUILTIN
from qkv.engines.cpu import native
from qkv.engines.kernelgen import c_mod, memo
from qkv.engines.triton import variant as triton_variant

from .conftest import rel_err

DOT = BUILTIN["dot"].pairwise
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def empty_caches():
    for cache in (triton_variant._TRACES, c_mod._TRACES):
        cache.clear()
    yield


def _count_traces(monkeypatch, module) -> list:
    calls = []
    real = module.trace_score_mod

    def counting(mod, graph):
        calls.append(mod)
        return real(mod, graph)

    monkeypatch.setattr(module, "trace_score_mod", counting)
    return calls


def test_key_covers_structure_and_tensor_metadata():
    slopes = torch.ones(4)
    key, tensors = memo.variant_key(qkv.sliding_window(3), Alibi(slopes))
    assert tensors == [slopes]
    assert memo.variant_key(qkv.sliding_window(3), Alibi(torch.zeros(4)))[0] == key
    for other in (
        (qkv.sliding_window(4), Alibi(slopes)),  # an attribute
        (qkv.sliding_window(3), Alibi(torch.ones(8))),  # a shape
        (qkv.sliding_window(3), Alibi(torch.ones(4, dtype=torch.float64))),  # a dtype
        (qkv.sliding_window(3), Alibi(torch.ones(4, requires_grad=True))),
        (qkv.sliding_window(3), None),
    ):
        assert memo.variant_key(*other)[0] != key
    assert memo.variant_key(qkv.softcap(2.0))[0] != memo.variant_key(qkv.softcap(2.0 + 1e-12))[0]


def test_key_says_which_places_share_a_tensor(monkeypatch):
    """One tensor read twice is one slot; two tensors in those places are two."""
    calls = _count_traces(monkeypatch, triton_variant)
    shared = torch.rand(4)
    once = triton_variant.trace_variant(DOT, None, Alibi(shared).then(Alibi(shared)), CPU, 16,
                                        64)
    a, b = torch.rand(4), torch.rand(4)
    twice = triton_variant.trace_variant(DOT, None, Alibi(a).then(Alibi(b)), CPU, 16, 64)
    assert len(calls) == 2
    assert len(once.slots) == 1
    assert len(twice.slots) == 2 and twice.slots[0] is a and twice.slots[1] is b


def test_user_callables_and_outside_subclasses_have_no_key():
    assert memo.variant_key(qkv.causal(), as_score_mod(lambda s, b, h, q, k: s)) is None
    assert memo.variant_key(qkv.custom_mask(lambda b, h, q, k: q >= k)) is None

    class Shifted(Alibi):  # defined outside qkv: its __call__ may read anything
        pass

    assert memo.variant_key(Shifted(torch.ones(2))) is None


def test_triton_trace_is_reused_with_this_calls_tensors(monkeypatch):
    calls = _count_traces(monkeypatch, triton_variant)
    first = triton_variant.trace_variant(DOT, qkv.causal(), qkv.alibi(4), CPU, 16, 64)
    slopes = torch.rand(4, requires_grad=False)
    second = triton_variant.trace_variant(DOT, qkv.causal(), Alibi(slopes), CPU, 16, 64)
    assert len(calls) == 1
    assert second.source == first.source
    assert second.slots[0] is slopes
    assert second.grad_slots == set() and first.slots[0] is not slopes


def test_triton_trace_follows_requires_grad(monkeypatch):
    calls = _count_traces(monkeypatch, triton_variant)
    plain = triton_variant.trace_variant(DOT, None, qkv.alibi(4), CPU, 16, 64)
    learnable = torch.rand(4, requires_grad=True)
    traced = triton_variant.trace_variant(DOT, None, Alibi(learnable), CPU, 16, 64)
    assert len(calls) == 2  # requires_grad is in the key: the code differs
    assert traced.grad_slots == {0} and plain.grad_slots == set()
    assert traced.slots[0] is learnable
    with torch.no_grad():  # grad mode is in the key too
        assert triton_variant.trace_variant(DOT, None, Alibi(learnable), CPU, 16, 64).slots[0] \
            is learnable
    assert len(calls) == 3


def test_user_score_mod_is_traced_every_call(monkeypatch):
    calls = _count_traces(monkeypatch, triton_variant)
    doubled = as_score_mod(lambda s, b, h, q, k: s * 2)
    for _ in range(3):
        triton_variant.trace_variant(DOT, None, doubled, CPU, 16, 64)
    assert len(calls) == 3
    assert len(triton_variant._TRACES) == 0


def _inputs(heads=4, kv_heads=2, nq=7, nk=19, d=16):
    g = torch.Generator().manual_seed(5)
    return (torch.randn(2, heads, nq, d, generator=g),
            torch.randn(2, kv_heads, nk, d, generator=g),
            torch.randn(2, kv_heads, nk, d, generator=g))


@pytest.mark.parametrize("make", [
    lambda: qkv.alibi(4, slopes=torch.rand(4)),
    lambda: qkv.softcap(float(torch.rand(()) * 5 + 1)),
    lambda: qkv.alibi(4, slopes=torch.rand(4)).then(qkv.softcap(3.0)),
], ids=["alibi", "softcap", "alibi_then_softcap"])
def test_fused_cpu_engine_reads_each_calls_values(monkeypatch, make):
    """Same structure, new tensors and values each call: one trace where the key allows,
    and every output equals the float64 reference of its own call."""
    q, k, v = _inputs()
    mask = qkv.causal()
    for _ in range(3):
        mod = make()
        with torch.no_grad():
            out = qkv.attention(q, k, v, mask=mask, score_mod=mod, backend="fused")
        ref = qkv.attention(q.double(), k.double(), v.double(), mask=mask, score_mod=mod,
                            backend="reference")
        assert rel_err(out, ref) < 1e-5
    # Traced for the C loops; without them the modifier runs on torch, untraced.
    assert (len(c_mod._TRACES) >= 1) == native.available(torch.float32)


def test_fused_cpu_engine_in_place_update_and_gradient():
    """A learnable slope updated in place between calls (an optimizer step) is read as it is
    now, and its gradient reaches the tensor of this call."""
    q, k, v = _inputs()
    slopes = torch.rand(4, requires_grad=True)
    mod = qkv.alibi(4, slopes=slopes)
    for step in range(3):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = qkv.attention(*leaves, mask=qkv.causal(), score_mod=mod, backend="fused")
        grads = torch.autograd.grad(out.square().sum(), [*leaves, slopes])
        ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
        ref_slopes = slopes.detach().double().requires_grad_()
        ref = qkv.attention(*ref_leaves, mask=qkv.causal(),
                            score_mod=qkv.alibi(4, slopes=ref_slopes), backend="reference")
        ref_grads = torch.autograd.grad(ref.square().sum(), [*ref_leaves, ref_slopes])
        assert rel_err(out, ref) < 1e-5
        for got, want in zip(grads, ref_grads, strict=True):
            assert rel_err(got, want) < 1e-4
        with torch.no_grad():
            slopes.add_(0.25 * (step + 1))
