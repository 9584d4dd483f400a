"""A traced term's gradient loops on CPU vector types (``kernelgen.c_vec``): which terms get
them, and that they give the reference's gradients, and the scalar loops' (the lanes of d
past the last whole vector, a dense mask's zero ds, key groups cut short by the tile)."""

import pytest
import torch

import qkv
from qkv.core.engines import native
from qkv.core.engines.kernelgen import c as c_target
from qkv.core.engines.kernelgen import c_vec
from qkv.core.engines.kernelgen.graph import CompileError, Graph
from qkv.core.engines.kernelgen.trace import trace_term

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


@pytest.mark.parametrize("name", ["l1", "sign_weighted"])
def test_the_vector_sign_is_torch_sign_at_ties_signed_zeros_and_nan(name):
    """sign(0) = sign(-0) = sign(NaN) = 0, as torch's: q and k on a grid of a few values
    (many ties, so q - k is 0 in many lanes), q with -0 where k has +0 (q - k is -0), and
    for q * sign(k) a NaN in k (its score term is 0 there, so every gradient is finite)."""
    g = torch.Generator().manual_seed(7)
    grid = torch.tensor([-1.0, -0.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    q = grid[torch.randint(0, 5, (1, 2, 29, D), generator=g)]
    k = grid[torch.randint(0, 5, (1, 2, 33, D), generator=g)]
    q[..., :5, 0], k[..., :5, 0] = -0.0, 0.0
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
