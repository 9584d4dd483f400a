"""The Triton engine on a real CUDA GPU, against the float64 reference on CPU.

The interpreter matrix of test_triton_engine.py (every similarity, mask and modifier, user
terms, odd sizes, D = 40, grouped heads, Nq != Nk) runs here compiled, in fp32, bf16 and fp16,
and test_triton_weighting.py's weightings in bf16 (one case per kind in all three), plus
problems large enough for many of the GPU's tiles (the weightings' among them), the
dispatcher's choices on CUDA and the compiled path. CI has no GPU, so the whole module skips
there.

Low-precision runs are compared with a float64 reference on the same rounded inputs, so
their error is the kernels' own: bf16 keeps 8 significant bits (2^-9 ≈ 2e-3 per rounding),
fp16 11 (2^-12 ≈ 2.4e-4). The output is rounded twice (P before P·V, then the result);
each gradient a few more times (dO, dS before their products), with sums over Nk.

``QKV_GPU_RESULTS=<dir>`` writes every measured error to ``<dir>/cuda_errors.json``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import qkv
from qkv import engines
from qkv.core.problem import build_problem
from qkv.core.reference import reference_attention

from ..versions import ONE_GRAPH
from . import test_triton_weighting as weighting_cases
from .test_triton_engine import (
    CASES,
    REGISTRY_GRAD_TOLERANCE,
    TOLERANCE,
    WEIGHT_CASES,
    _relative_error,
    run_case,
    run_dropout_case,
    run_integer_positions_case,
    run_lse_sinks_case,
    run_weights_case,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (CI has none: test_triton_engine.py runs these kernels in "
           "Triton's interpreter instead)",
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (output, gradients) relative error vs float64 on the same rounded inputs.
LOW_PRECISION = {"bf16": (1.2e-2, 3e-2), "fp16": (1.5e-3, 4e-3)}
# The gradient of a scalar a score modifier reads sums ds·∂mod/∂t over every pair, with
# cancellation: on an H200 its error is about 10x that of q's gradient in fp32 and 19-35x in
# fp16/bf16, so in low precision it gets 5x the gradient bound.
SCALAR_FACTOR = 5.0
RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    folder = os.environ.get("QKV_GPU_RESULTS")
    if folder and RESULTS:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(os.path.join(folder, f"cuda_errors_{worker}.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def _tolerances(name: str, dtype: str) -> tuple[float, float]:
    if dtype == "fp32":
        return TOLERANCE, REGISTRY_GRAD_TOLERANCE if name.startswith("registry_") else TOLERANCE
    return LOW_PRECISION[dtype]


def _assert_within(result: dict, dtype: str, out_tolerance: float, grad_tolerance: float):
    """A case's errors under its bounds (a learnable scalar's gradient gets SCALAR_FACTOR in
    low precision), and exact zeros on rows with no allowed key."""
    assert result["out"] < out_tolerance, result
    for error, scalar in zip(result["grads"], result["scalar"], strict=True):
        factor = SCALAR_FACTOR if scalar and dtype != "fp32" else 1.0
        assert error < grad_tolerance * factor, result
    assert result["empty_rows_exact"], "rows with no allowed key must give exact zeros"


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", list(CASES))
def test_matrix_matches_float64_forward_and_gradients(name, dtype):
    result = run_case(name, "cuda", DTYPES[dtype])
    RESULTS[f"{name}/{dtype}"] = result
    assert "error" not in result, result["error"]
    _assert_within(result, dtype, *_tolerances(name, dtype))


# Every weighting case in bf16; one per kernel kind in fp32 and fp16 too (each dtype is a
# compile of its own, and the tests stage has minutes).
WEIGHTING_RUNS = [(name, "bf16") for name in weighting_cases.CASES] + [
    (name, dtype) for name in ("sigmoid_learnable_bias_l2_padding",
                               "softpick_causal_rows_without_keys", "stick_causal_gqa_kv_cache")
    for dtype in ("fp32", "fp16")]


@pytest.mark.parametrize(("name", "dtype"), WEIGHTING_RUNS)
def test_weightings_match_float64_forward_and_gradients(name, dtype):
    """test_triton_weighting.py's cases (sigmoid, relu, identity, a user's function,
    softpick, stick-breaking) compiled."""
    result = weighting_cases.run_case(name, "cuda", DTYPES[dtype])
    RESULTS[f"weighting_{name}/{dtype}"] = result
    tolerances = ((weighting_cases.TOLERANCE, weighting_cases._grad_tolerance(name))
                  if dtype == "fp32" else LOW_PRECISION[dtype])
    _assert_within(result, dtype, *tolerances)


@pytest.mark.parametrize("name", list(WEIGHT_CASES))
def test_weights_from_saved_lse(name):
    result = run_weights_case(name, "cuda")
    RESULTS[f"weights_{name}"] = result
    assert "error" not in result, result["error"]
    assert max(result["out"], result["weights"]) < TOLERANCE, result


def test_dropout_with_the_kernels_keep_mask():
    result = run_dropout_case("cuda")
    RESULTS["dropout"] = result
    assert abs(result["kept"] - 0.7) < 0.08, result
    assert max(result["out"], result["weights"], *result["grads"]) < TOLERANCE, result


def test_positions_past_the_float_bound():
    """ALiBi's distances in integers (the bound for float positions lowered below the case's
    sizes), compiled: the form longer sequences than 2**20 get."""
    result = run_integer_positions_case("cuda", torch.float32)
    RESULTS["integer_positions"] = result
    assert "error" not in result, result["error"]
    assert result["float_sources"] and not any(result["float_sources"]), result
    assert result["out"] < TOLERANCE and max(result["grads"]) < TOLERANCE, result


def test_lse_and_sinks():
    result = run_lse_sinks_case("cuda")
    RESULTS["lse_sinks"] = result
    assert max(result["out"], result["lse"], *result["grads"]) < TOLERANCE, result


USER_WEIGHT = torch.linspace(0.5, 1.5, 64)
USER = qkv.Similarity(lambda q, k: -USER_WEIGHT * (q - k).abs(), name="cuda_user")
# Many tiles, ragged ends, Nq != Nk, grouped heads, D = 40 (padded), 64 and 128:
# (similarity, mask, score_mod, weighting, (B, H, Hkv, Nq, Nk, D))
LARGE = {
    "dot_causal_alibi_d128": ("dot", "causal", "alibi", "softmax", (2, 4, 2, 1000, 1000, 128)),
    "dot_window_softcap_kv_cache": ("dot", "sliding", "softcap", "softmax",
                                    (1, 4, 4, 777, 1000, 64)),
    "dot_segments_d40": ("dot", "segments", None, "softmax", (1, 2, 1, 1000, 1000, 40)),
    "cosine_d40": ("cosine", None, None, "softmax", (1, 2, 1, 1000, 1000, 40)),
    "l2_causal_d128": ("l2", "causal", None, "softmax", (1, 4, 2, 1000, 1000, 128)),
    "l1_padding": ("l1", "padding", None, "softmax", (2, 2, 1, 600, 1000, 64)),
    "user_causal": (USER, "causal", None, "softmax", (1, 2, 2, 1000, 1000, 64)),
    "sigmoid_causal_d128": ("dot", "causal", None, "sigmoid", (2, 4, 2, 1000, 1000, 128)),
    "softpick_padding": ("dot", "padding", None, "softpick", (2, 2, 1, 600, 1000, 64)),
    "stick_breaking_causal_kv_cache": ("dot", "causal", None, "stick_breaking",
                                       (1, 4, 2, 777, 1000, 64)),
    "relu_window_alibi": ("dot", "sliding", "alibi", "relu", (1, 4, 4, 1000, 1000, 64)),
    "identity_d40": ("dot", None, None, "identity", (1, 2, 1, 1000, 1000, 40)),
}


def _large_problem(name: str, dtype, device):
    sim, mask_name, mod, weighting, (b, h, hkv, nq, nk, d) = LARGE[name]
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(*s, generator=g).to(torch.bfloat16).to(device=device, dtype=dtype)
               .requires_grad_() for s in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, d)))
    ids = torch.arange(nk) * 7 // nk
    mask = {None: None, "causal": qkv.causal(), "sliding": qkv.sliding_window(300, 0),
            "segments": qkv.segments(ids.to(device)),
            "padding": qkv.padding(torch.tensor([nk - 37, 512], device=device))}[mask_name]
    score_mod = {None: None, "alibi": qkv.alibi(h), "softcap": qkv.softcap(20.0)}[mod]
    problem = build_problem(q, k, v, mask=mask, score_mod=score_mod, similarity=sim,
                            weighting=weighting)
    dout = torch.randn(b, h, nq, d, generator=g).to(torch.bfloat16).to(device=device, dtype=dtype)
    return problem, [q, k, v], dout


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", list(LARGE))
def test_large_problems_on_many_tiles(name, dtype):
    torch.cuda.manual_seed(0)
    problem, inputs, dout = _large_problem(name, DTYPES[dtype], "cuda")
    out = engines.plan(problem, "triton").run().out
    assert torch.isfinite(out).all()
    grads = torch.autograd.grad(out, inputs, dout)
    ref_problem, ref_inputs, ref_dout = _large_problem(name, torch.float64, "cpu")
    ref = reference_attention(ref_problem)[0]
    ref_grads = torch.autograd.grad(ref, ref_inputs, ref_dout)
    errors = [_relative_error(t.cpu(), r) for t, r in zip((out, *grads), (ref, *ref_grads),
                                                            strict=True)]
    RESULTS[f"large_{name}/{dtype}"] = {"out": errors[0], "grads": errors[1:]}
    out_tolerance, grad_tolerance = (1e-5, 1e-4) if dtype == "fp32" else LOW_PRECISION[dtype]
    assert errors[0] < out_tolerance and max(errors[1:]) < grad_tolerance, errors


def test_dispatch_on_cuda():
    """Plain and causal dot and cosine go to SDPA; every other variant to the Triton
    kernels."""
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    pick = {name: engines.plan(build_problem(q, q, q, **kw)).engine for name, kw in {
        "dot": {}, "causal": {"mask": qkv.causal()},
        "alibi": {"mask": qkv.causal(), "score_mod": qkv.alibi(2)},
        "l1": {"similarity": "l1"}, "user": {"similarity": USER},
        "cosine": {"similarity": "cosine"},
        "cosine_causal": {"similarity": "cosine", "mask": qkv.causal()},
        "l2": {"similarity": "l2"},
        "graph": {"mask": qkv.graph(torch.randint(0, 128, (2, 512), device="cuda"))},
    }.items()}
    assert pick == {"dot": "sdpa", "causal": "sdpa", "alibi": "triton", "l1": "triton",
                    "user": "triton", "cosine": "sdpa", "cosine_causal": "sdpa",
                    "l2": "triton", "graph": "triton"}, pick


@pytest.fixture
def triton_only(monkeypatch):
    """The compiled call must run the Triton kernels: no other engine may take it."""
    monkeypatch.setattr(engines, "ENGINES", [e for e in engines.ENGINES if e.name == "triton"])


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_call_runs_the_triton_kernels(triton_only, backend):
    torch._dynamo.reset()
    slopes = (torch.rand(4, device="cuda") + 0.1).requires_grad_()

    def fn(q, k, v):
        return qkv.attention(q, k, v, mask=qkv.causal(), score_mod=qkv.alibi(slopes=slopes),
                             similarity="l2")

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 4, 300, 64, device="cuda", generator=g, dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    compiled = torch.compile(fn, backend=backend, fullgraph=ONE_GRAPH)
    dout = torch.randn(2, 4, 300, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    eager_out = fn(q, k, v)
    eager = torch.autograd.grad(eager_out, (q, k, v, slopes), dout)
    ours_out = compiled(q, k, v)
    ours = torch.autograd.grad(ours_out, (q, k, v, slopes), dout)
    errors = [_relative_error(a.float(), b.double()) for a, b in
              zip((ours_out, *ours), (eager_out, *eager), strict=True)]
    RESULTS[f"compiled_{backend}"] = {"errors": errors}
    assert max(errors) < 1e-6, errors  # the same kernels on the same inputs
