"""A traced term's gradient loops on CPU vector types (``kernelgen.c_vec``): which terms get
them, and that they give the reference's gradients, and the scalar loops' (the lanes of d
past the last whole vector, a dense mask's zero ds, key groups cut short by the tile)."""

import pytest
import torch

import qkv
from qkv.engines.cpu import native
from qkv.engines.kernelgen import c as c_target
from qkv.engines.kernelgen import c_vec
from qkv.engines.kernelgen.derivative import derivative
from qkv.engines.kernelgen.graph import CompileError, Graph
from qkv.engines.kernelgen.trace import trace_term

from .conftest import rand_qkv, rel_err

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native.available(torch.float32), reason="no C compiler")]

# d for every path of the loops: with 8 lanes (AVX2, float) two vectors together, one alone
# and 3 lanes past them; with 4 (double) 6 vectors and 3 lanes; with 16, one and 11 lanes
D = 27
FIXED = torch.linspace(0.5, 1.5, D)  # captured, needs no gradient
LEARNED = torch.linspace(0.5, 1.5, D).requires_grad_()

VECTOR_TERMS = {
    "l1": lambda q, k: -(q - k).abs(),
    "asymmetric": lambda q, k: -torch.where(q > k, q - k, 2 * (k - q)),
    "hinge": lambda q, k: -torch.maximum(q - k, torch.zeros_like(q)),
    "abs_weighted": lambda q, k: q.abs() * k,  # |q| in dk: the vector abs
    "fixed_weight": lambda q, k: -FIXED * (q - k).abs(),
    "sign_weighted": lambda q, k: q * k.sign(),  # the vector sign in dq
}
SCALAR_TERMS = {  # the scalar loops were faster on these (c_vec.MAX_OPERATIONS)
    "cubed": lambda q, k: -(q - k).abs() ** 3,
    "gaussian": lambda q, k: torch.exp(-(q - k) ** 2),
    "learned_weight": lambda q, k: -LEARNED * (q - k).abs(),
}


def _source(term, dtype=torch.float32) -> str:
    graph = Graph("cpu", D)
    return c_target._source(trace_term(term, graph), dtype)


@pytest.mark.parametrize("name", VECTOR_TERMS)
def test_small_terms_of_float_values_get_vector_loops(name):
    for dtype in (torch.float32, torch.float64):
        assert "term_grads_vec(" in _source(VECTOR_TERMS[name], dtype)


@pytest.mark.parametrize("name", SCALAR_TERMS)
def test_larger_terms_math_functions_and_learned_tensors_keep_the_scalar_loops(name):
    assert "term_grads_vec(" not in _source(SCALAR_TERMS[name])


def test_only_a_tensor_that_needs_a_gradient_gets_gradient_sums():
    assert "total_0" in _source(SCALAR_TERMS["learned_weight"])
    assert "total_0" not in _source(VECTOR_TERMS["fixed_weight"])


def test_integer_arithmetic_has_no_vector_form():
    graph = Graph("cpu", D)
    pd = graph.leaf("pd", "int")
    with pytest.raises(CompileError, match="integer"):
        c_vec.vector_groups(graph.leaf("pq", "float") * (pd + 1).float(), None, pd, "float",
                            "const float *A0")


def _grads(term, inputs, upstream, dtype, backend="fused", mask=None):
    """The gradients in q, k and v of attention over ``inputs`` (float64) in ``dtype``."""
    args = [t.to(dtype).requires_grad_() for t in inputs]
    out = qkv.attention(*args, similarity=qkv.Similarity(term), mask=mask, backend=backend)
    return torch.autograd.grad(out, args, upstream.to(dtype))


def _attention(term, dtype, mask, backend="fused"):
    upstream = torch.randn(2, 4, 37, 5, generator=torch.Generator().manual_seed(5),
                           dtype=torch.float64)
    return _grads(term, rand_qkv(2, 4, 2, 37, 45, D, 5, seed=4), upstream, dtype, backend, mask)


@pytest.mark.parametrize("mask", ["none", "causal", "dense"])
@pytest.mark.parametrize("name", VECTOR_TERMS)
def test_vector_loops_match_the_reference_and_the_scalar_loops(monkeypatch, name, mask):
    """45 keys: whole groups (16 keys, or 8 over two vectors of d) and a cut one; causal
    and a dense mask leave ds 0 on some of a query's keys and on all of them."""
    dense = torch.rand(2, 1, 37, 45, generator=torch.Generator().manual_seed(6)) > 0.5
    dense[:, :, :3] = False
    mask = {"none": None, "causal": qkv.causal(), "dense": dense}[mask]
    term = VECTOR_TERMS[name]
    ref = _attention(term, torch.float64, mask, backend="reference")
    vector = _attention(term, torch.float32, mask)
    for g, r in zip(vector, ref, strict=True):
        assert rel_err(g, r) < 1e-5
    assert rel_err(_attention(term, torch.float64, mask)[0], ref[0]) < 1e-12

    def declined(*args):
        raise CompileError("scalar loops only, for this test")

    monkeypatch.setattr(c_vec, "vector_groups", declined)
    scalar = _attention(term, torch.float32, mask)
    for g, s in zip(vector, scalar, strict=True):
        assert rel_err(g, s) < 1e-6


def _tied_inputs(negative_zero: bool, g: torch.Generator):
    """q (1, 2, 29, D) and k (1, 2, 33, D) on a grid of a few values (many ties, so q - k is
    0 in many lanes); with ``negative_zero``, -0 among them and in q where k has +0 (there
    q - k is -0)."""
    grid = torch.tensor([-1.0, -0.0, 0.0, 0.5, 1.0] if negative_zero else [-1.0, 0.0, 0.5, 1.0],
                        dtype=torch.float64)
    q = grid[torch.randint(0, len(grid), (1, 2, 29, D), generator=g)]
    k = grid[torch.randint(0, len(grid), (1, 2, 33, D), generator=g)]
    if negative_zero:
        q[..., :5, 0], k[..., :5, 0] = -0.0, 0.0
    return q, k


@pytest.mark.parametrize("negative_zero", [True, False])
@pytest.mark.parametrize("name", ["l1", "sign_weighted"])
def test_the_vector_sign_is_torch_sign_at_ties_signed_zeros_and_nan(name, negative_zero):
    """sign(0) = sign(-0) = sign(NaN) = 0, as torch's: at ties, at -0 (then the loops keep
    the full sign: ``halved_sign`` needs inputs without -0), and for q * sign(k) at a NaN in k
    (its score term is 0 there, so every gradient is finite). Without -0, L1's loops take
    the halved sign."""
    g = torch.Generator().manual_seed(7)
    q, k = _tied_inputs(negative_zero, g)
    if name == "sign_weighted":
        k[0, 1, 3:9, 2] = float("nan")
    v = torch.randn(1, 2, 33, 5, generator=g, dtype=torch.float64)
    upstream = torch.randn(1, 2, 29, 5, generator=g, dtype=torch.float64)
    term = VECTOR_TERMS[name]
    ref = _grads(term, (q, k, v), upstream, torch.float64, "reference")
    assert all(r.isfinite().all() for r in ref)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        for got, r in zip(_grads(term, (q, k, v), upstream, dtype), ref, strict=True):
            assert rel_err(got, r) < tol


HALVED = {  # c_vec.halved_sign's terms: a sign of q - k that both derivatives are linear in
    "l1": VECTOR_TERMS["l1"],
    "fixed_weight": VECTOR_TERMS["fixed_weight"],
    "reversed_scaled": lambda q, k: 0.5 * (k - q).abs(),
    "squared": lambda q, k: -(q - k).abs() * (q - k).abs(),  # sign |x| + |x| sign
    "plus_q_sign": lambda q, k: (q - k).abs() + q * (q - k).sign(),  # d_q: sign + sign
}
NOT_HALVED = {
    "sign_of_k": VECTOR_TERMS["sign_weighted"],  # sign(k): not a difference of q and k
    "asymmetric": VECTOR_TERMS["asymmetric"],  # no sign
    "two_signs": lambda q, k: -(q - k).abs() - (q + k).abs(),
    "plus_q": lambda q, k: -(q - k).abs() + q,  # d_q = -sign(x) + 1: not doubled by it
    "times_q": lambda q, k: -(q - k).abs() * q,  # d_q = -sign(x) q - |x|: not linear
}


def _derivatives(term):
    graph = Graph("cpu", D)
    root = trace_term(term, graph)
    return [derivative(root, graph.leaf(name, "float"), {}) for name in ("pq", "pk")]


@pytest.mark.parametrize("name", [*HALVED, *NOT_HALVED])
def test_the_halved_sign_takes_a_sign_of_q_minus_k_that_the_derivatives_are_linear_in(name):
    found = c_vec.halved_sign(*_derivatives({**HALVED, **NOT_HALVED}[name]))
    assert (found is not None) == (name in HALVED)
    if found is not None:
        assert found.op == "sign"


def test_plain_values_are_free_of_nan_infinity_and_negative_zero():
    clean = torch.randn(2, 3, 5)
    clean[0, 0, :2] = 0.0
    assert c_target.plain_values(clean, torch.zeros(0), torch.ones(4))
    for bad in (float("nan"), float("inf"), float("-inf"), -0.0):
        dirty = clean.clone()
        dirty[1, 2, 3] = bad
        assert not c_target.plain_values(clean, dirty), bad


def _halved(source: str) -> bool:
    """Whether generated source calls the halved sign (and halves the sums it stores where
    the halved sign is 2 sign(x): all but AVX-512, whose sign is one operation)."""
    calls = source.count("qkv_vsign2(") - source.count("qkv_vsign2(qkv_v x)")
    assert (calls > 0) == ("(scale * QKV_SIGN2_HALF)" in source)
    return calls > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_halved_sign_is_written_for_plain_inputs_only(dtype):
    q, k = torch.randn(1, 2, 9, D), torch.randn(1, 2, 11, D)
    root = trace_term(HALVED["l1"], Graph("cpu", D))
    assert c_target.plain_values(q, k)
    assert _halved(c_target._source(root, dtype, plain=True))
    assert not _halved(c_target._source(root, dtype))  # the forward's: no inputs
    other = trace_term(NOT_HALVED["times_q"], Graph("cpu", D))
    assert not _halved(c_target._source(other, dtype, plain=True))
    k[0, 1, 4, 7] = -0.0
    assert not c_target.plain_values(q, k)
    assert not _halved(c_target._source(root, dtype, plain=False))


@pytest.mark.parametrize("name", ["l1", "squared", "reversed_scaled", "plus_q_sign"])
def test_the_halved_sign_gives_the_full_signs_gradients_bit_for_bit(monkeypatch, name):
    """On tied inputs without -0 (q - k is +0 in many lanes), with a causal mask (ds 0 on
    some keys): the halved loops' gradients equal the full sign's exactly."""
    g = torch.Generator().manual_seed(8)
    q, k = _tied_inputs(False, g)
    v = torch.randn(1, 2, 33, 5, generator=g, dtype=torch.float64)
    upstream = torch.randn(1, 2, 29, 5, generator=g, dtype=torch.float64)
    term, mask = HALVED[name], qkv.causal()
    chosen = []
    real = c_target.plain_values
    monkeypatch.setattr(c_target, "plain_values", lambda *t: chosen.append(real(*t)) or
                        chosen[-1])
    halved = _grads(term, (q, k, v), upstream, torch.float32, mask=mask)
    assert chosen == [True]
    monkeypatch.setattr(c_target, "plain_values", lambda *t: False)
    full = _grads(term, (q, k, v), upstream, torch.float32, mask=mask)
    for a, b in zip(halved, full, strict=True):
        assert torch.equal(a, b)
    ref = _grads(term, (q, k, v), upstream, torch.float64, "reference", mask=mask)
    for a, r in zip(halved, ref, strict=True):
        assert rel_err(a, r) < 1e-5
