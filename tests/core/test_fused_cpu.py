"""The fused CPU engine against the float64 reference: forward and every gradient, over every
registered similarity (built-in and conftest's user examples) x mask kind x score modifier,
with tiles small enough that every mask mixes EMPTY, PARTIAL and FULL tiles and N is not a
multiple of the block size."""

import pytest
import torch

import qkv
from qkv.core import scores
from qkv.core.problem import build_problem
from qkv.core.similarity import SIMILARITIES as REGISTRY
from qkv.engines import plan
from qkv.engines.cpu import graph_gather, tiles

from .conftest import mask_cases, rand_qkv, registered_similarities, rel_err

B, H, HKV, NQ, NK, D, DV = 2, 4, 2, 37, 45, 8, 5
SIMILARITIES = registered_similarities(D)
MASKS = list(mask_cases(B, NQ, NK))
MODS = ["none", "alibi_softcap", "relative_bias", "closure", "additive_bias"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(tiles, "BLOCK_Q", 8)
    monkeypatch.setattr(tiles, "BLOCK_K", 8)
    monkeypatch.setattr(tiles, "SPAN_K", 16)  # runs of two key blocks merge


def make_params(dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    metric = torch.randn(H, D, D, generator=g, dtype=dtype) / D**0.5 + torch.eye(D, dtype=dtype)
    return {
        "metric": metric,
        "slopes": torch.rand(H, generator=g, dtype=dtype),
        "table": torch.randn(8, H, generator=g, dtype=dtype),
        "bias": torch.randn(NQ, NK, generator=g, dtype=dtype),
        "scale": torch.rand(H, generator=g, dtype=dtype) + 0.5,
    }


def make_mod(kind, params):
    if kind == "none":
        return None
    if kind == "alibi_softcap":
        return [qkv.alibi(slopes=params["slopes"]), qkv.softcap(3.0)]
    if kind == "relative_bias":
        return qkv.relative_bias(params["table"], num_buckets=8, max_distance=16)
    if kind == "additive_bias":  # SDPA's float attn_mask, as qkv.attention spells it
        return scores.AdditiveBias(params["bias"])
    bias = params["bias"]  # captured by the closure: its gradient must come back too

    def closure_mod(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx, kv_idx] * (h + 1)

    return closure_mod


def run(backend, q, k, v, params, similarity, mask, mod, **extra):
    metric = params["metric"] if REGISTRY[similarity].needs_metric else None
    return qkv.attention(
        q, k, v, mask=mask, score_mod=make_mod(mod, params), similarity=similarity,
        metric=metric, backend=backend, **extra,
    )


def grads_of(out, inputs, seed=4):
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
    return [torch.zeros_like(x) if gr is None else gr for x, gr in zip(inputs, grads, strict=True)]


def compare(similarity, mask, mod, dtype, out_tol, grad_tol, scale=None, engine="fused"):
    """``engine`` (the fused CPU engine, or the graph engine) in ``dtype`` against the float64
    reference on the same values.

    A scalar a user's term reads (a temperature) sums every pair's gradient, and those nearly
    cancel (softmax rows): its float32 gradient is as far from float64 as the float32
    *reference*'s is (2.6e-4 for the Laplacian's τ under segments, measured). For such a
    tensor the bound is twice the float32 reference's own error, or ``grad_tol``."""
    q, k, v = rand_qkv(B, H, HKV, NQ, NK, D, DV, dtype=dtype)
    params = make_params(dtype)
    extra = {} if scale is None else {"scale": params["scale"] if scale == "tensor" else scale}
    results = []
    runs = [(engine, dtype), ("reference", torch.float64)]
    if REGISTRY[similarity].tensors() and dtype != torch.float64:
        runs.append(("reference", dtype))
    for backend, cast in runs:
        leaves = [t.detach().to(cast).requires_grad_() for t in (q, k, v)]
        p64 = {n: t.detach().to(cast).requires_grad_() for n, t in params.items()}
        if "scale" in extra and scale == "tensor":
            extra["scale"] = p64["scale"]
        out = run(backend, *leaves, p64, similarity, mask, mod, **extra)
        inputs = leaves + [p64[n] for n in ("metric", "slopes", "table", "bias", "scale")]
        inputs += REGISTRY[similarity].tensors()  # shared by both runs: a user term's tensors
        results.append((out, grads_of(out, inputs)))
    (out, grads), (ref, ref_grads) = results[:2]
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= out_tol
    names = ["q", "k", "v", "metric", "slopes", "table", "bias", "scale"]
    names += ["term tensor"] * (len(grads) - len(names))
    for i, (name, g, r) in enumerate(zip(names, grads, ref_grads, strict=True)):
        assert torch.isfinite(g).all(), name
        if r.norm() > 0:
            tol = grad_tol
            if name == "term tensor" and len(results) > 2:
                tol = max(grad_tol, 2 * rel_err(results[2][1][i], r))
            assert rel_err(g, r) <= tol, (name, rel_err(g, r), tol)
        else:
            assert g.norm() == 0, name


@pytest.mark.parametrize("mod", MODS)
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_fused_matches_reference_float64(similarity, mask_name, mod):
    compare(similarity, mask_cases(B, NQ, NK)[mask_name], mod, torch.float64, 1e-12, 1e-10)


@pytest.mark.parametrize("mask_name", ["none", "causal", "segments", "graph_edges", "combined"])
@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_fused_float32_within_targets(similarity, mask_name):
    mod = "alibi_softcap" if mask_name != "none" else "relative_bias"
    compare(similarity, mask_cases(B, NQ, NK)[mask_name], mod, torch.float32, 1e-5, 1e-4)


@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_fused_bfloat16_within_targets(similarity):
    compare(similarity, qkv.causal(), "alibi_softcap", torch.bfloat16, 2e-2, 2e-2)


@pytest.mark.parametrize("scale", ["tensor", 0.7, -0.4, 0.0])
@pytest.mark.parametrize("similarity", ["dot", "l2", "l1", "mahalanobis"])
def test_scale_gradients(similarity, scale):
    """A number scale folded into the features (dot any; L2, Mahalanobis and L1 when > 0) or
    left to the tiles (a tensor, or <= 0), with the modifier's C loops or without."""
    compare(similarity, qkv.causal(), "none", torch.float64, 1e-12, 1e-10, scale=scale)
    compare(similarity, None, "alibi_softcap", torch.float32, 1e-5, 1e-4, scale=scale)


@pytest.mark.parametrize("similarity", SIMILARITIES)
@pytest.mark.parametrize("mod", ["none", "alibi_softcap", "closure"])
def test_gather_path_matches_reference(monkeypatch, similarity, mod):
    """The graph engine (forced sparse) against the reference, grouped heads included."""
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    monkeypatch.setattr(graph_gather, "_CHUNK_EDGES", 20)  # several chunks
    compare(similarity, mask_cases(B, NQ, NK)["graph_edges"], mod, torch.float64, 1e-12, 1e-10,
            engine="graph")


@pytest.mark.parametrize("scale", ["tensor", 0.7])
def test_gather_path_float32_and_scale(monkeypatch, scale):
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    monkeypatch.setattr(graph_gather, "_CHUNK_EDGES", 20)
    compare("l2", mask_cases(B, NQ, NK)["graph_edges"], "alibi_softcap", torch.float32, 1e-5,
            1e-4, scale=scale, engine="graph")


def test_sparse_graph_takes_gather_path(monkeypatch):
    n = 200
    edges = torch.stack([torch.randint(0, n, (4 * n,)), torch.arange(n).repeat_interleave(4)])
    mask = qkv.graph(edges, num_nodes=n)
    assert graph_gather.is_sparse(mask, n, n)
    calls = []
    original = graph_gather._forward
    monkeypatch.setattr(graph_gather, "_forward", lambda *a: calls.append(1) or original(*a))
    q, k, v = rand_qkv(1, 2, 2, n, n, 8, 8)
    qkv.attention(q, k, v, mask=mask)
    assert calls
    problem = build_problem(q, k, v, mask=mask)
    assert plan(problem).engine == "graph"
    assert "too many edges" in graph_gather.why_not(build_problem(q, k, v, mask=qkv.graph(
        torch.ones(n, n, dtype=torch.bool))))


def test_modifier_cases_cover_every_modifier_kind():
    """The engine matrices iterate ``MODS``: a ScoreMod class defined in scores.py without a
    case there fails here."""
    defined = {cls for cls in vars(scores).values() if isinstance(cls, type)
               and issubclass(cls, scores.ScoreMod) and cls is not scores.ScoreMod}
    covered = set()
    for kind in MODS:
        mod = scores.as_score_mod(make_mod(kind, make_params(torch.float64)))
        if mod is not None:
            covered.add(type(mod))
            covered |= {type(m) for m in getattr(mod, "mods", ())}
    assert defined <= covered, f"no case for {sorted(c.__name__ for c in defined - covered)}"
