"""Traces kept between calls (``kernelgen.memo``): masks, modifiers and terms, qkv's own and
a user's, are traced once per structure; a hit reads this call's tensors; a callable that
reads a value no key stands for is traced on every call."""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.core.scores import Alibi, as_score_mod
from qkv.core.similarity import BUILTIN
from qkv.engines.cpu import native
from qkv.engines.kernelgen import c as c_target
from qkv.engines.kernelgen import c_mod, memo
from qkv.engines.lowering import Lowered
from qkv.engines.triton import traced as triton_traced

from .conftest import rel_err

DOT = BUILTIN["dot"].pairwise
CPU = torch.device("cpu")


def _triton_trace(pair, mask, score_mod, device, head_dim, positions):
    return triton_traced.trace_functions(Lowered(pair, score_mod, mask, None), device, head_dim,
                                         positions)


@pytest.fixture(autouse=True)
def empty_caches():
    for cache in (triton_traced._TRACES, c_mod._TRACES):
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
    calls = _count_traces(monkeypatch, triton_traced)
    shared = torch.rand(4)
    once = _triton_trace(DOT, None, Alibi(shared).then(Alibi(shared)), CPU, 16,
                                        64)
    a, b = torch.rand(4), torch.rand(4)
    twice = _triton_trace(DOT, None, Alibi(a).then(Alibi(b)), CPU, 16, 64)
    assert len(calls) == 2
    assert len(once.slots) == 1
    assert len(twice.slots) == 2 and twice.slots[0] is a and twice.slots[1] is b


def test_user_callables_are_keyed_by_code_and_what_they_read():
    scale = torch.ones(4)

    def by_head(s, b, h, q, k):
        return s * scale[h]

    key, tensors = memo.variant_key(qkv.causal(), as_score_mod(by_head))
    assert tensors == [scale]
    assert memo.variant_key(qkv.causal(), as_score_mod(by_head))[0] == key
    scale = torch.zeros(4)  # new values, same metadata: the same key, this tensor read
    again, tensors = memo.variant_key(qkv.causal(), as_score_mod(by_head))
    assert again == key and tensors[0] is scale
    scale = torch.zeros(8)
    assert memo.variant_key(qkv.causal(), as_score_mod(by_head))[0] != key

    def capped(cap):
        return as_score_mod(lambda s, b, h, q, k: cap * torch.tanh(s / cap))

    assert memo.variant_key(capped(2.0))[0] == memo.variant_key(capped(2.0))[0]
    assert memo.variant_key(capped(2.0))[0] != memo.variant_key(capped(3.0))[0]
    assert memo.variant_key(as_score_mod(lambda s, b, h, q, k: s))[0] != memo.variant_key(
        as_score_mod(lambda s, b, h, q, k: s * 1))[0]  # another code object


def test_values_no_key_stands_for_and_outside_subclasses_have_no_key():
    table = {"cap": 2.0}
    assert memo.variant_key(as_score_mod(lambda s, b, h, q, k: s * table["cap"])) is None

    class Shifted(Alibi):  # defined outside qkv: its __call__ may read anything
        pass

    assert memo.variant_key(Shifted(torch.ones(2))) is None


def test_triton_trace_is_reused_with_this_calls_tensors(monkeypatch):
    calls = _count_traces(monkeypatch, triton_traced)
    first = _triton_trace(DOT, qkv.causal(), qkv.alibi(4), CPU, 16, 64)
    slopes = torch.rand(4, requires_grad=False)
    second = _triton_trace(DOT, qkv.causal(), Alibi(slopes), CPU, 16, 64)
    assert len(calls) == 1
    assert second.source == first.source
    assert second.slots[0] is slopes
    assert second.grad_slots == set() and first.slots[0] is not slopes


def test_triton_trace_follows_requires_grad(monkeypatch):
    calls = _count_traces(monkeypatch, triton_traced)
    plain = _triton_trace(DOT, None, qkv.alibi(4), CPU, 16, 64)
    learnable = torch.rand(4, requires_grad=True)
    traced = _triton_trace(DOT, None, Alibi(learnable), CPU, 16, 64)
    assert len(calls) == 2  # requires_grad is in the key: the code differs
    assert traced.grad_slots == {0} and plain.grad_slots == set()
    assert traced.slots[0] is learnable
    with torch.no_grad():  # grad mode is in the key too
        assert _triton_trace(DOT, None, Alibi(learnable), CPU, 16, 64).slots[0] \
            is learnable
    assert len(calls) == 3


def test_user_score_mod_is_traced_once(monkeypatch):
    calls = _count_traces(monkeypatch, triton_traced)
    for _ in range(3):
        _triton_trace(DOT, None, as_score_mod(lambda s, b, h, q, k: s * 2), CPU,
                                     16, 64)
    assert len(calls) == 1
    assert len(triton_traced._TRACES) == 1


def test_a_trace_that_may_have_read_values_is_not_kept(monkeypatch):
    """A tensor the trace read without making it a slot (``.item()``) may be baked into the
    code: such a trace is made again on every call."""
    calls = _count_traces(monkeypatch, c_mod)
    weight = torch.tensor(2.0)
    baked = as_score_mod(lambda s, b, h, q, k: s * weight.item())
    q, k, v = _inputs()
    for value in (2.0, 3.0):
        weight.fill_(value)
        with torch.no_grad():
            out = qkv.attention(q, k, v, score_mod=baked, backend="fused")
        ref = qkv.attention(q.double(), k.double(), v.double(), scale=value / 4,
                            backend="reference")
        assert rel_err(out, ref) < 1e-5
    assert len(c_mod._TRACES) == 0
    assert len(calls) == (2 if native.available(torch.float32) else 0)


def _assert_step_matches_reference(score_mod, weight, reference_mod) -> None:
    """One fused training step on causal ``_inputs`` with ``score_mod``, which reads the
    learnable ``weight``: its output and the gradients of q, k, v and ``weight`` equal the
    float64 reference's, whose modifier is ``reference_mod`` of a float64 copy of it."""
    q, k, v = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = qkv.attention(*leaves, mask=qkv.causal(), score_mod=score_mod, backend="fused")
    got = torch.autograd.grad(out.square().sum(), [*leaves, weight])
    ref_weight = weight.detach().double().requires_grad_()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = qkv.attention(*ref_leaves, mask=qkv.causal(), score_mod=reference_mod(ref_weight),
                        backend="reference")
    want = torch.autograd.grad(ref.square().sum(), [*ref_leaves, ref_weight])
    assert rel_err(out, ref) < 1e-5
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) < 1e-4


def _times_head_weight(weight):
    return lambda s, b, h, q_idx, kv_idx: s * weight[h]


def test_user_closure_over_a_changing_tensor_reads_each_steps_values(monkeypatch):
    """A user's modifier closing over a learnable tensor is traced once, reads the values of
    each step, and its gradient reaches the tensor."""
    calls = _count_traces(monkeypatch, c_mod)
    bias = torch.rand(4, requires_grad=True)

    def per_head(s, b, h, q_idx, kv_idx):
        return s * bias[h]

    for step in range(3):
        _assert_step_matches_reference(per_head, bias, _times_head_weight)
        with torch.no_grad():
            bias.add_(0.5 * (step + 1))
        if step == 0:
            traced_first = len(calls)
    # One trace per pass (the forward's without grad mode, the backward's with it), then none.
    assert len(calls) == traced_first == (2 if native.available(torch.float32) else 0)


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
    slopes = torch.rand(4, requires_grad=True)
    mod = qkv.alibi(4, slopes=slopes)
    for step in range(3):
        _assert_step_matches_reference(mod, slopes, lambda w: qkv.alibi(4, slopes=w))
        with torch.no_grad():
            slopes.add_(0.25 * (step + 1))


def test_user_similarity_term_is_traced_once():
    """A user's pairwise term keeps its C loops (CPU) and its Triton trace between calls."""
    c_target._TRACES.clear()
    weight = torch.rand(16)
    sim = qkv.Similarity(lambda a, b: -(a - b).abs() * weight)
    for _ in range(3):
        _triton_trace(sim.pairwise, None, None, CPU, 16, 64)
        c_target.traced_loops(sim.pairwise, torch.float32, 16)
    assert len(triton_traced._TRACES) == 1
    assert len(c_target._TRACES) == (1 if native.available(torch.float32) else 0)
    q, k, v = _inputs()
    out = qkv.attention(q, k, v, similarity=sim, backend="fused")
    ref = qkv.attention(q.double(), k.double(), v.double(), backend="reference",
                        similarity=qkv.Similarity(lambda a, b: -(a - b).abs() * weight.double()))
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize(("term", "checks"), [
    (lambda a, b: -(a - b).square(), 0),  # no sign in its gradient: nothing to check
    (lambda a, b: -(a - b).abs(), 2),  # sign(q - k): halved for plain values, checked
], ids=["square", "l1"])
def test_backward_checks_for_plain_values_only_where_the_code_differs(monkeypatch, term,
                                                                     checks):
    """A user's term's backward looks over q and k for NaN, infinity and -0 only when its
    gradient loops have a shorter form without them (``c_vec.halved_sign``); gradients match
    the float64 reference either way."""
    if not native.available(torch.float32):
        pytest.skip("no C compiler")
    c_target._TRACES.clear()
    seen = []
    real = c_target.plain_values
    monkeypatch.setattr(c_target, "plain_values", lambda *t: seen.append(1) or real(*t))
    sim = qkv.Similarity(term)
    q, k, v = (t.requires_grad_() for t in _inputs())
    for _ in range(2):
        out = qkv.attention(q, k, v, similarity=sim, mask=qkv.causal(), backend="fused")
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert len(seen) == checks
    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = qkv.attention(*ref_inputs, similarity=sim, mask=qkv.causal(), backend="reference")
    for got, want in zip(grads, torch.autograd.grad(ref.square().sum(), ref_inputs),
                         strict=True):
        assert rel_err(got, want) < 1e-4
