"""Every registered similarity (built-in and the user-defined examples of conftest) through
the fused CPU engine x every mask kind, against the reference: float64 exactly, float32
within 1e-5 (outputs) and 1e-4 (gradients) of float64. Grouped heads, Nq != Nk, and tiles
that N is not a multiple of; the graph gather path as well. Adding a similarity to the
registry adds it here: there is no list to edit."""

import pytest
import torch

import qkv
from qkv.core import similarity as similarity_module
from qkv.core.similarity import BUILTIN, SIMILARITIES
from qkv.engines.cpu import graph_gather, native, tiles
from qkv.engines.kernelgen import c as c_target

from .conftest import (
    EXAMPLE_D,
    mask_cases,
    rand_qkv,
    registered_similarities,
    rel_err,
    similarity_inputs,
)

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, HKV, NQ, NK, DV = 2, 4, 2, 9, 11, 3
MASKS = list(mask_cases(B, NQ, NK))


def run(name, mask, dtype, backend, metric):
    q, k, v = (t.to(dtype).requires_grad_() for t in rand_qkv(B, H, HKV, NQ, NK, EXAMPLE_D, DV))
    metric = None if metric is None else metric.detach().to(dtype).requires_grad_()
    tensors = [metric] if metric is not None else []
    tensors += list(SIMILARITIES[name].tensors())
    out = qkv.attention(q, k, v, mask=mask, similarity=name, metric=metric,
                        score_mod=qkv.softcap(4.0), backend=backend)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(3),
                           dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v, *tensors), upstream)
    return out, grads


@pytest.fixture
def small_tiles(monkeypatch):
    """4 x 4 blocks merged into spans of 8 keys: N = 9 and 11 leave ragged last tiles."""
    monkeypatch.setattr(tiles, "BLOCK_Q", 4)
    monkeypatch.setattr(tiles, "BLOCK_K", 4)
    monkeypatch.setattr(tiles, "SPAN_K", 8)


@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("name", registered_similarities())
def test_fused_engine_matches_reference(small_tiles, name, mask_name):
    mask = mask_cases(B, NQ, NK)[mask_name]
    metric, _ = similarity_inputs(name, H, EXAMPLE_D)
    ref, ref_grads = run(name, mask, torch.float64, "reference", metric)
    out, grads = run(name, mask, torch.float64, "fused", metric)
    assert rel_err(out, ref) < 1e-12
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-10
    out32, grads32 = run(name, mask, torch.float32, "fused", metric)
    assert out32.dtype == torch.float32 and rel_err(out32, ref) < 1e-5
    for g, r in zip(grads32, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-4


@pytest.mark.parametrize("name", registered_similarities())
def test_graph_gather_path_matches_reference(monkeypatch, name):
    """Sparse graphs take the graph engine (forced here): scores along edges from the term's
    C loops or its definition, gradients to the tensors the term reads."""
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    calls = []
    original = graph_gather._forward
    monkeypatch.setattr(graph_gather, "_forward",
                        lambda *a: calls.append(1) or original(*a))
    mask = mask_cases(B, NQ, NK)["graph_edges"]
    metric, _ = similarity_inputs(name, H, EXAMPLE_D)
    ref, ref_grads = run(name, mask, torch.float64, "reference", metric)
    out, grads = run(name, mask, torch.float64, "graph", metric)
    assert calls, "the gather path did not run"
    assert rel_err(out, ref) < 1e-12
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-10


def test_examples_are_registered_and_learn():
    assert {"p3", "weighted_l1", "laplacian"} <= set(SIMILARITIES)
    q, k, v = rand_qkv(1, 2, 1, 6, 6, EXAMPLE_D, 2, requires_grad=True)
    for name in ("weighted_l1", "laplacian"):
        tensors = SIMILARITIES[name].tensors()
        assert tensors, f"{name} reads a learnable tensor"
        out = qkv.attention(q, k, v, similarity=name, backend="fused")
        grads = torch.autograd.grad(out.square().sum(), tensors)
        assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


def test_user_similarity_equals_its_formula():
    """-Σ|q_d - k_d|³ and the Laplacian kernel, as scores recovered from the weights."""
    q, k, v = rand_qkv(1, 2, 2, 5, 7, EXAMPLE_D, 2)
    diff = q.unsqueeze(-2) - k.unsqueeze(-3)
    tau = SIMILARITIES["laplacian"].tensors()[0].detach()
    for name, scores in (("p3", -diff.abs().pow(3).sum(-1) / EXAMPLE_D ** 0.5),
                         ("laplacian", -diff.abs().sum(-1) / tau)):
        _, w = qkv.attention(q, k, v, similarity=name, return_weights=True, backend="reference")
        torch.testing.assert_close(w, torch.softmax(scores, -1), rtol=1e-12, atol=1e-12)


def test_similarity_object_without_registering_and_features():
    """A Similarity passed directly; features (unit vectors) then a pairwise term."""
    sim = qkv.Similarity(lambda q, k: -(q - k).square(),
                         features=lambda x: torch.nn.functional.normalize(x, dim=-1), scale=2.0)
    q, k, v = rand_qkv(1, 2, 1, 5, 7, EXAMPLE_D, 2, requires_grad=True)
    out = qkv.attention(q, k, v, similarity=sim, backend="fused")
    ref = qkv.attention(q, k, v, similarity=sim, backend="reference")
    expected = qkv.attention(torch.nn.functional.normalize(q, dim=-1),
                             torch.nn.functional.normalize(k, dim=-1), v, similarity="l2",
                             scale=2.0, backend="reference")
    assert rel_err(out, ref) < 1e-12 and rel_err(ref, expected) < 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k))
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-10


def test_a_user_dot_product_with_features_is_not_sent_to_sdpa():
    sim = qkv.Similarity(features=lambda x: 2.0 * x)  # q·k of doubled features: 4 q·k
    q, k, v = rand_qkv(1, 2, 2, 5, 5, EXAMPLE_D, 2)
    out = qkv.attention(q, k, v, similarity=sim)
    want = qkv.attention(q, k, v, scale=4 / EXAMPLE_D ** 0.5, backend="reference")
    assert rel_err(out, want) < 1e-12


def test_registry_errors():
    with pytest.raises(ValueError, match="built-in"):
        qkv.register_similarity("l1", qkv.Similarity(lambda q, k: q * k))
    with pytest.raises(TypeError, match="qkv.Similarity"):
        qkv.register_similarity("mine", lambda q, k: q * k)
    with pytest.raises(TypeError, match="callable"):
        qkv.Similarity(3.0)
    with pytest.raises(ValueError, match="registered"):
        qkv.attention(*rand_qkv(), similarity="not_registered")


def test_modules_and_model_configs_take_a_registered_name():
    w = torch.nn.Parameter(torch.ones(8))
    qkv.register_similarity("test_weighted_l1_d8", qkv.Similarity(lambda q, k: -w * (q - k).abs()))
    mha = qkv.nn.MultiHeadAttention(16, 2, similarity="test_weighted_l1_d8")
    assert any(p is w for p in mha.parameters())
    mha(torch.randn(2, 5, 16)).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0
    block = {"d_model": 16, "n_head": 2, "similarity": "test_weighted_l1_d8"}
    gpt = qkv.models.GPT(qkv.models.GPTConfig(vocab_size=11, block_size=8, n_layer=1,
                                               block=block))
    logits = gpt(torch.randint(0, 11, (1, 6)))
    assert logits.shape[:2] == (1, 6) and torch.isfinite(logits).all()
    with pytest.raises(ValueError, match="similarity must be one of"):
        qkv.nn.MultiHeadAttention(16, 2, similarity="nope")


@pytest.mark.skipif(not native.available(torch.float64), reason="no C compiler")
@pytest.mark.parametrize("engine", ["fused", "graph"])
@pytest.mark.parametrize("name", ["p3", "weighted_l1", "laplacian"])
def test_user_terms_run_in_generated_c_loops(monkeypatch, small_tiles, name, engine):
    """A user's term is traced and compiled to C loops, on tiles and along graph edges
    (scores, their derivative and the gradients of the tensors it reads), with no torch
    fallback on the way."""
    built = []
    original = c_target.traced_loops
    monkeypatch.setattr(c_target, "traced_loops",
                        lambda *a: built.append(original(*a)) or built[-1])
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    mask = mask_cases(B, NQ, NK)["combined" if engine == "fused" else "graph_edges"]
    ref, ref_grads = run(name, mask, torch.float64, "reference", None)
    # From here the torch forms of the term would raise: the engine must not use them.
    monkeypatch.setattr(similarity_module.Pairwise, "scores", None)
    monkeypatch.setattr(similarity_module.Pairwise, "rows", None)
    out, grads = run(name, mask, torch.float64, engine, None)
    assert built and built[-1] is not None
    assert rel_err(out, ref) < 1e-12
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-10


@pytest.mark.parametrize("engine", ["fused", "graph"])
@pytest.mark.parametrize("name", sorted(set(registered_similarities()) - set(BUILTIN)))
def test_user_similarities_gradcheck_on_the_cpu_engines(monkeypatch, small_tiles, engine, name):
    """float64 gradcheck through the engines themselves (generated C loops on tiles, the term's
    definition along graph edges), the tensors the term reads included."""
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    q, k, v = rand_qkv(1, 2, 1, 6, 7, EXAMPLE_D, 2, requires_grad=True)
    mask = qkv.graph(torch.rand(6, 7, generator=torch.Generator().manual_seed(5)) > 0.4)
    learnable = list(SIMILARITIES[name].tensors())

    def fn(q, k, v, *_):
        return qkv.attention(q, k, v, mask=mask, similarity=name, backend=engine)

    assert torch.autograd.gradcheck(fn, (q, k, v, *learnable), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.skipif(not native.available(torch.float64), reason="no C compiler")
@pytest.mark.parametrize(("dtype", "d"), [(torch.float64, 20), (torch.float32, 40),
                                          (torch.float32, 64)])
def test_generated_gradient_loops_over_whole_and_partial_vectors(dtype, d):
    """The generated gradient loops against autograd on the term's torch form, with d both a
    whole number of vectors and not, key groups cut short, and ds with zero rows, zero key
    groups and scattered zeros (where the derivative is infinite: 0, never 0 * inf)."""
    weight = torch.linspace(0.5, 1.5, d, dtype=torch.float64).requires_grad_()
    # -(weight * ...): -weight would be a new tensor, computed before tracing
    sim = qkv.Similarity(lambda q, k: -(weight * (q - k).abs().sqrt()), name="weighted_root")
    gen = torch.Generator().manual_seed(3)
    nb, m, n = 3, 37, 45
    q = torch.randn(nb, m, d, generator=gen, dtype=torch.float64)
    k = torch.randn(nb, n, d, generator=gen, dtype=torch.float64)
    ds = torch.randn(nb, m, n, generator=gen, dtype=torch.float64)
    ds[0, 4] = 0  # a query with no key
    ds[1, :, 16:32] = 0  # a whole group of keys
    ds[2, 7, 40] = 0  # one pair in a group that has others, where the derivative is infinite
    k[2, 40] = q[2, 7]
    loops = c_target.traced_loops(sim.pairwise, dtype, d)
    assert loops is not None
    gq, gk = torch.zeros_like(q, dtype=dtype), torch.zeros_like(k, dtype=dtype)
    (gw,) = loops.add_grads(ds.to(dtype), q.to(dtype), k.to(dtype), gq, gk)
    # the reference reads the inputs as the loops do (float32 rounding moves sqrt's slope)
    leaves = (q.to(dtype).double().requires_grad_(), k.to(dtype).double().requires_grad_(),
              weight)
    keep = (ds != 0).unsqueeze(-1)  # the reference's own 0 * inf where ds is 0 would be NaN
    diff = (leaves[0][:, :, None] - leaves[1][:, None]).abs()
    terms = -(weight * torch.where(keep, diff, torch.ones_like(diff)).sqrt())
    want = torch.autograd.grad(terms.sum(-1), leaves, ds)
    bound = 1e-12 if dtype == torch.float64 else 2e-5
    for got, expected in zip((gq, gk, gw), want, strict=True):
        assert got.isfinite().all()
        assert rel_err(got, expected) < bound
