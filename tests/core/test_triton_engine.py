"""The Triton engine against the float64 reference, forward and every gradient.

CI has no GPU, so the kernels run in Triton's interpreter (TRITON_INTERPRET=1, fp32). The
interpreter must be switched on before Triton is imported, so the whole case matrix runs once
in a subprocess (this file run as a script) and each test checks its own case's result.
Tracing and compile errors need no kernel launch and are tested in-process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

import qkv
from qkv.core.masks import FULL
from qkv.core.problem import build_problem
from qkv.core.reference import reference_attention
from qkv.core.scores import as_score_mod
from qkv.core.similarity import SIMILARITIES
from qkv.engines import engine_names
from qkv.engines import triton as triton_engine
from qkv.engines.lowering import TermKind, term_kind
from qkv.engines.triton.blocks import classify

from .conftest import EXAMPLE_D, registered_similarities
from .test_compile import GRAD_TOLERANCE as COMPILE_GRAD_TOLERANCE
from .test_compile import OUT_TOLERANCE as COMPILE_OUT_TOLERANCE
from .test_compile import TRITON_CASES as COMPILE_CASES

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = 1e-5  # relative error of fp32 kernels vs float64, forward and gradients
# The registry's cases: a scalar such as a temperature sums every pair's gradient (with
# cancellation) in fp32 atomics, so gradients get the 1e-4.
REGISTRY_GRAD_TOLERANCE = 1e-4


def _edges(nq: int, nk: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.stack([torch.randint(0, nk, (4 * nq,), generator=g),
                        torch.randint(0, nq, (4 * nq,), generator=g)])


def _dense(b: int, nq: int, nk: int) -> torch.Tensor:
    allowed = torch.rand(b, 1, nq, nk, generator=torch.Generator().manual_seed(4)) > 0.5
    allowed[:, :, 3] = False  # a row with no allowed key
    return allowed


# name -> (call kwargs, shape); shapes are (B, H, Hkv, Nq, Nk, D, Dv). Tiles are 16 x 16 in the
# interpreter, so 40 and 24 leave ragged last tiles, and D=40 pads to 64.
BASE = (1, 2, 1, 40, 40, 40, 24)
CASES = {
    "dot": ({}, BASE),
    "dot_causal_kv_cache": ({"mask": "causal"}, (1, 2, 1, 24, 40, 40, 24)),
    "dot_causal_rows_without_keys": ({"mask": "causal"}, (1, 2, 2, 40, 24, 40, 40)),
    "cosine_sliding_window": ({"similarity": "cosine", "mask": "sliding"}, BASE),
    "l2_causal": ({"similarity": "l2", "mask": "causal"}, BASE),
    "l1": ({"similarity": "l1"}, (1, 2, 1, 40, 24, 40, 24)),
    "l1_padding": ({"similarity": "l1", "mask": "padding"}, (2, 2, 1, 24, 40, 16, 16)),
    "mahalanobis_per_head_metric": ({"similarity": "mahalanobis"}, BASE),
    "dot_segments": ({"mask": "segments"}, (2, 1, 1, 40, 40, 40, 24)),
    "dot_graph": ({"mask": "graph"}, BASE),
    "dot_bool_tensor": ({"mask": "dense"}, (2, 1, 1, 40, 40, 40, 24)),
    "l2_combined_masks": ({"similarity": "l2", "mask": "combined"}, (2, 1, 1, 40, 40, 40, 24)),
    "dot_custom_mask": ({"mask": "custom"}, BASE),
    # Full tiles that are not consecutive (0 and 2 of each axis): the kernels look them up in
    # the block table instead of counting them.
    "dot_full_tiles_with_gaps": ({"mask": "gaps"}, (1, 2, 1, 40, 64, 40, 24)),
    "dot_alibi_learned_slopes": ({"mask": "causal", "score_mod": "alibi"}, BASE),
    "dot_relative_bias_table": ({"score_mod": "relative_bias"}, BASE),
    "dot_softcap_sliding": ({"mask": "sliding", "score_mod": "softcap"}, BASE),
    "l1_user_score_mod_head_scale": ({"similarity": "l1", "score_mod": "user", "scale": "heads"},
                                     BASE),
    "dot_decode_one_query": ({"mask": "causal"}, (1, 2, 1, 1, 37, 64, 64)),
    "dot_not_causal_or_graph": ({"mask": "not_causal_or_graph"}, (1, 2, 1, 20, 20, 16, 16)),
    "dot_floor_division_mask_batch_mod": ({"mask": "floor_division", "score_mod": "batch"},
                                          (2, 2, 2, 20, 20, 16, 16)),
    # FlexAttention-style callables that index one dimension at a time (bias[b][kv_idx]).
    "flex_bias_table_doc_mask": ({"mask": "flex_doc", "score_mod": "flex"},
                                 (2, 2, 1, 40, 40, 16, 16)),
    "dot_flex_and_or_masks": ({"mask": "flex_combinators"}, BASE),
    # torch.relu, torch.sign and .square(), traced as selects and products.
    "dot_relu_sign_square_score_mod": ({"mask": "causal", "score_mod": "functions"}, BASE),
}

# Every registered similarity (built-in and the user-defined examples of conftest, whose terms
# are traced into Triton) under each of four mask kinds, with grouped heads and Nq != Nk: two
# sequences (of different lengths for padding), two query heads on one key head (the
# interpreter's time grows with B·H; a scalar's gradient, summed over every pair, needs
# this many pairs to keep within its tolerance).
for _name in registered_similarities():
    for _mask in (None, "causal", "padding", "graph"):
        CASES[f"registry_{_name}_{_mask or 'none'}"] = (
            {"similarity": _name, "mask": _mask, "score_mod": "softcap"},
            (2, 2, 1, 24, 37, EXAMPLE_D, 8))

# Weights recomputed from the saved log-sum-exp (return_weights=True, no gradient).
WEIGHT_CASES = {
    "weights_l1_causal_gqa": ({"similarity": "l1", "mask": "causal"}, (1, 2, 1, 24, 40, 40, 24)),
    "weights_dot_graph_alibi": ({"mask": "graph", "score_mod": "alibi"}, (1, 2, 2, 40, 40, 16, 16)),
}


def _mask(name: str | None, b: int, nq: int, nk: int, device="cpu"):
    lengths = torch.tensor([nk - 3, 5][:b], device=device)
    ids = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 30 + [1] * 10], device=device)
    doc = _DOC.to(device)
    makers = {
        None: lambda: None,
        "causal": qkv.causal,
        "sliding": lambda: qkv.sliding_window(9, 2),
        "padding": lambda: qkv.padding(lengths),
        "segments": lambda: qkv.segments(ids),
        "graph": lambda: qkv.graph(_edges(nq, nk).to(device)),
        "dense": lambda: _dense(b, nq, nk).to(device),
        "combined": lambda: (qkv.causal() | qkv.sliding_window(0, 2)) & qkv.padding(lengths),
        "custom": lambda: qkv.custom_mask(lambda b, h, q, kv: ((q - kv) % 3 == 0) | (kv < 4)),
        "gaps": lambda: qkv.custom_mask(lambda b, h, q, kv: ((q // 16) % 2 == 0)
                                        & ((kv // 16) % 2 == 0)),
        "not_causal_or_graph": lambda: ~qkv.causal() | qkv.graph(_edges(nq, nk).to(device)),
        # Python's floor semantics on negative operands, whatever the backend's division does.
        "flex_doc": lambda: qkv.custom_mask(
            lambda b, h, q, kv: doc[b][q] == doc[b][kv]
        ),
        # FlexAttention's own combinators, which start from b.new_ones(()) / new_zeros(()).
        "flex_combinators": lambda: qkv.custom_mask(or_masks(
            and_masks(lambda b, h, q, kv: q >= kv, lambda b, h, q, kv: q - kv <= 9),
            lambda b, h, q, kv: kv < 2)),
        "floor_division": lambda: qkv.custom_mask(
            lambda b, h, q, kv: (((q - kv) // 3) % 2 == 0) | (q // 4 == kv // 4)
        ),
    }
    return makers[name]()


_DOC = torch.stack([torch.arange(64) // 16, torch.arange(64) // 10])  # (2, 64) document ids


def _leaves(name: str | None, heads: int, d: int) -> list[torch.Tensor]:
    """Values of the learnable tensors a case's score modifier or metric reads."""
    g = torch.Generator().manual_seed(5)
    return {
        "alibi": [torch.rand(heads, generator=g) + 0.1],
        "relative_bias": [torch.randn(32, heads, generator=g)],
        "user": [torch.tensor(0.7)],
        "flex": [torch.randn(2, 64, generator=g), torch.randn(heads, 127, generator=g)],
        "mahalanobis": [torch.eye(d) + 0.2 * torch.randn(heads, d, d, generator=g)],
        "heads": [torch.rand(heads, generator=g) * 0.3 + 0.1],
    }.get(name, [])


def _score_mod(name: str | None, leaves: list[torch.Tensor]):
    if name is None:
        return None
    if name == "softcap":
        return qkv.softcap(2.0)
    if name == "alibi":
        return qkv.alibi(slopes=leaves[0])
    if name == "relative_bias":
        return qkv.relative_bias(leaves[0], num_buckets=32, max_distance=20)
    if name == "flex":
        bias, table = leaves
        return lambda s, b, h, q, kv: s + bias[b][kv] + table[h][q - kv + 63]
    if name == "batch":
        return lambda s, b, h, q, kv: s + b * 0.5 - (h == 1) * 0.25
    if name == "functions":
        return lambda s, b, h, q, kv: (s - 0.5 * torch.relu(s - 1.0) + 0.1 * torch.sign(s)
                                       + s.square() / 64)
    temperature = leaves[0]
    return lambda s, b, h, q, kv: torch.where(q >= kv, s * temperature, s - 1.0) + torch.tanh(s)


def build_case(name: str, dtype: torch.dtype, return_weights: bool = False, device="cpu",
               values_in: torch.dtype | None = None):
    """The problem for a case in ``dtype`` on ``device``, its differentiable inputs and an
    upstream grad. ``values_in`` rounds every drawn value through that dtype first, so that a
    float64 reference sees exactly the values a bf16 or fp16 run gets."""
    spec, (b, h, hkv, nq, nk, d, dv) = {**CASES, **WEIGHT_CASES}[name]
    g = torch.Generator().manual_seed(0)

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(values_in or dtype).to(device=device, dtype=dtype)

    q, k, v = (place(torch.randn(*shape, generator=g)).requires_grad_()
               for shape in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
    sim = spec.get("similarity", "dot")
    mod_leaves, metric, scale = (
        [place(t).requires_grad_() for t in _leaves(kind, h, d)]
        for kind in (spec.get("score_mod"),
                     "mahalanobis" if SIMILARITIES[sim].needs_metric else None,
                     spec.get("scale"))
    )
    problem = build_problem(
        q, k, v, mask=_mask(spec.get("mask"), b, nq, nk, device),
        score_mod=_score_mod(spec.get("score_mod"), mod_leaves), similarity=sim,
        scale=scale[0] if scale else None, metric=metric[0] if metric else None,
        dropout_p=0.0, return_weights=return_weights,
    )
    grad_out = place(torch.randn(b, h, nq, dv, generator=torch.Generator().manual_seed(9)))
    term_tensors = list(SIMILARITIES[sim].tensors())  # shared by the fp32 and float64 runs
    return problem, [q, k, v, *metric, *mod_leaves, *scale, *term_tensors], grad_out


def _relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def run_triton(problem):
    """The Triton engine's plan for ``problem`` (in the interpreter on CPU): out, or (out,
    weights)."""
    runner = triton_engine.plan(problem, on_cpu=True)
    assert not isinstance(runner, str), runner
    result = runner()
    return (result.out, result.weights) if problem.return_weights else result.out


def run_reference(problem):
    out, weights, _ = reference_attention(problem)
    return (out, weights) if problem.return_weights else out


def run_case(name: str, device="cpu", dtype=torch.float32) -> dict:
    """Errors of output and every gradient vs float64 (run in the interpreter subprocess, or
    on CUDA by test_triton_cuda.py)."""

    problem, inputs, grad_out = build_case(name, dtype, device=device)
    reason = triton_engine.unsupported(problem)
    if reason is not None:
        return {"error": f"unsupported: {reason}"}
    start = time.perf_counter()
    out = run_triton(problem)
    grads = torch.autograd.grad(out, inputs, grad_out)
    seconds = time.perf_counter() - start
    ref_problem, ref_inputs, _ = build_case(name, torch.float64, values_in=dtype)
    ref = run_reference(ref_problem)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double().cpu())
    out, grads = out.cpu(), [t.cpu() for t in grads]
    empty_rows = ref.abs().amax(-1) == 0
    exact_zero = bool((out[empty_rows] == 0).all() and (grads[0][empty_rows] == 0).all())
    return {
        "seconds": seconds,
        "out": _relative_error(out, ref),
        "grads": [_relative_error(a, r) for a, r in zip(grads, ref_grads, strict=True)],
        "scalar": [t.numel() == 1 for t in inputs],  # summed over every pair
        "empty_rows": int(empty_rows.sum()),
        "empty_rows_exact": exact_zero,
    }


def run_weights_case(name: str, device="cpu") -> dict:
    """Runs in the interpreter subprocess (or on CUDA): errors of output and weights vs
    float64."""

    with torch.no_grad():
        problem, _, _ = build_case(name, torch.float32, return_weights=True, device=device)
        reason = triton_engine.unsupported(problem)
        if reason is not None:
            return {"error": f"unsupported: {reason}"}
        out, weights = run_triton(problem)
        ref_out, ref_weights = run_reference(build_case(name, torch.float64, True)[0])
    return {"out": _relative_error(out.cpu(), ref_out),
            "weights": _relative_error(weights.cpu(), ref_weights)}


def run_dropout_case(device="cpu") -> dict:
    """Runs in the interpreter subprocess (or on CUDA). Dropout draws its own random numbers, so the
    reference reuses the kernels' keep mask, read from the weights of a run with the same seed:
    out, weights and gradients must then match float64."""
    from qkv.core.reference import expand_kv_heads, masked_softmax, scores_of

    dropout_p = 0.3
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, h, n, 40, generator=g).to(device)
            for h, n in ((2, 24), (1, 40), (1, 40))]

    def problem(tensors, weights):
        return build_problem(*tensors, mask=qkv.causal(), score_mod=qkv.alibi(2),
                             similarity="l2", scale=None, metric=None, dropout_p=dropout_p,
                             return_weights=weights)

    torch.manual_seed(7)
    with torch.no_grad():
        _, weights = run_triton(problem(base, True))
    torch.manual_seed(7)
    inputs = [t.clone().requires_grad_() for t in base]
    out = run_triton(problem(inputs, False))
    grad_out = torch.randn(out.shape, generator=g).to(device)
    grads = [t.cpu() for t in torch.autograd.grad(out, inputs, grad_out)]
    out, weights, grad_out = out.cpu(), weights.cpu(), grad_out.cpu()
    ref_inputs = [t.double().cpu().requires_grad_() for t in base]
    probabilities, _ = masked_softmax(scores_of(problem(ref_inputs, False), *ref_inputs[:2]))
    ref_weights = probabilities * (weights != 0) / (1 - dropout_p)
    ref = ref_weights @ expand_kv_heads(ref_inputs[2], 2)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double())
    return {
        "kept": (weights != 0)[probabilities > 0].double().mean().item(),
        "out": _relative_error(out, ref),
        "weights": _relative_error(weights, ref_weights),
        "grads": [_relative_error(a, r) for a, r in zip(grads, ref_grads, strict=True)],
    }


def run_lse_sinks_case(device="cpu") -> dict:
    """Runs in the interpreter subprocess (or on CUDA): the kernels' lse (natural units, -inf
    on rows with no key) and sinks applied on it, with gradients through both, vs float64."""
    from qkv.engines.api import with_sinks

    g = torch.Generator().manual_seed(3)
    base = [torch.randn(2, h, n, 40, generator=g).to(device)
            for h, n in ((4, 30), (2, 24), (2, 24))]
    sinks = torch.randn(4, generator=g).to(device)
    weight = torch.randn(2, 4, 30, generator=g)

    def loss(tensors, sink, runner):
        problem = build_problem(*tensors, mask=qkv.causal(), score_mod=qkv.alibi(4),
                                similarity="l1", needs_lse=True)
        result = runner(problem)
        out, lse, _ = with_sinks(result.out, result.lse, None, sink, problem.v)
        return out, lse, out.square().sum() + (lse * weight.to(lse)).sum()

    def triton_runner(problem):
        return triton_engine.plan(problem, on_cpu=True)()

    def reference_runner(problem):
        out, _, lse = reference_attention(problem)
        return type("R", (), {"out": out, "lse": lse})

    inputs = [t.clone().requires_grad_() for t in (*base, sinks)]
    out, lse, total = loss(inputs[:3], inputs[3], triton_runner)
    grads = [t.cpu() for t in torch.autograd.grad(total, inputs)]
    out, lse = out.cpu(), lse.cpu()
    ref_inputs = [t.double().cpu().requires_grad_() for t in (*base, sinks)]
    ref_out, ref_lse, ref_total = loss(ref_inputs[:3], ref_inputs[3], reference_runner)
    ref_grads = torch.autograd.grad(ref_total, ref_inputs)
    return {
        "out": _relative_error(out, ref_out),
        "lse": _relative_error(lse, ref_lse),
        "grads": [_relative_error(a, r) for a, r in zip(grads, ref_grads, strict=True)],
    }


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    # As a module from the repository root, so that it imports conftest's registrations.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "tests.core.test_triton_engine"], env=env,
                          capture_output=True, text=True, timeout=900, cwd=root)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            name, result = json.loads(line[len("RESULT "):])
            results[name] = result
    if not results:
        pytest.fail(f"the interpreter subprocess produced no results:\n{done.stderr[-4000:]}")
    return results


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", list(CASES))
def test_matches_float64_reference_forward_and_gradients(interpreter_results, name):
    result = interpreter_results[name]
    assert "error" not in result, result["error"]
    assert result["out"] < TOLERANCE, result
    grad_tolerance = REGISTRY_GRAD_TOLERANCE if name.startswith("registry_") else TOLERANCE
    assert max(result["grads"]) < grad_tolerance, result
    assert result["empty_rows_exact"], "rows with no allowed key must give exact zeros"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", list(WEIGHT_CASES))
def test_weights_from_saved_lse_match_float64_reference(interpreter_results, name):
    result = interpreter_results[name]
    assert "error" not in result, result["error"]
    assert result["out"] < TOLERANCE and result["weights"] < TOLERANCE, result


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_dropout_matches_float64_with_the_kernels_keep_mask(interpreter_results):
    result = interpreter_results["dropout"]
    assert "error" not in result, result["error"]
    assert abs(result["kept"] - 0.7) < 0.08, result  # dropout_p = 0.3, a few hundred draws
    assert max(result["out"], result["weights"], *result["grads"]) < TOLERANCE, result


def run_integer_positions_case(device="cpu", dtype=torch.float32) -> dict:
    """Runs in the interpreter subprocess (or on CUDA): learned ALiBi with positions past the
    bound up to which the kernels compute |q - k| in float (lowered here to 16 of the case's
    40), so the integer form of the generated code runs."""
    from qkv.engines.triton import traced

    limit = traced.POSITION_LIMIT
    traced.POSITION_LIMIT = 16
    traced._TRACES.clear()
    try:
        result = run_case("dot_alibi_learned_slopes", device, dtype)
        result["float_sources"] = [value.source.count("q_idx.to(tl.float32)")
                                   for value in traced._TRACES.values()]
        return result
    finally:
        traced.POSITION_LIMIT = limit
        traced._TRACES.clear()


def test_position_arithmetic_is_float_below_the_bound_only():
    """ALiBi's |q - k| in float from the position vectors below POSITION_LIMIT; above it, in
    integers (float32 holds every integer only up to 2**24). Index arithmetic that is not a
    sum of positions (a floor division, the head index) stays integer."""
    from qkv.engines.kernelgen.triton_emit import POSITION_LIMIT
    from qkv.engines.lowering import Lowered
    from qkv.engines.triton.traced import trace_functions

    pair, cpu = SIMILARITIES["dot"].pairwise, torch.device("cpu")
    alibi = Lowered(pair, qkv.alibi(4), qkv.causal(), None)
    short = trace_functions(alibi, cpu, 64, POSITION_LIMIT).source
    long = trace_functions(alibi, cpu, 64, POSITION_LIMIT + 1).source
    assert "q_idx.to(tl.float32)" in short and "kv_idx.to(tl.float32)" in short
    assert "q_idx.to(tl.float32)" not in long and "tl.abs(" in long
    halved = as_score_mod(lambda s, b, h, q, k: s - ((q - k) // 2).abs().float())
    source = trace_functions(Lowered(pair, halved, None, None), cpu, 64, 128).source
    assert "q_idx.to(tl.float32)" not in source


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_positions_past_the_float_bound_match_float64(interpreter_results):
    result = interpreter_results["integer_positions"]
    assert "error" not in result, result["error"]
    assert result["float_sources"] and not any(result["float_sources"]), result
    assert result["out"] < TOLERANCE and max(result["grads"]) < TOLERANCE, result


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_compiled_in_one_graph_matches_eager(interpreter_results, name):
    result = interpreter_results[f"compile_{name}"]
    assert "error" not in result, result["error"]
    assert result["out"] <= COMPILE_OUT_TOLERANCE, result
    assert result["grads"] <= COMPILE_GRAD_TOLERANCE, result


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_lse_and_sinks_match_float64_with_gradients(interpreter_results):
    result = interpreter_results["lse_sinks"]
    assert "error" not in result, result["error"]
    assert max(result["out"], result["lse"], *result["grads"]) < TOLERANCE, result


def test_weights_with_gradients_needed_are_refused_with_a_reason():
    problem, _, _ = build_case("weights_l1_causal_gqa", torch.float32, return_weights=True)
    assert "log-sum-exp without a gradient" in triton_engine.unsupported(problem)


def test_gaps_case_has_full_tiles_that_are_not_consecutive():
    problem, _, _ = build_case("dot_full_tiles_with_gaps", torch.float64)
    states = classify(problem.mask, 1, 2, problem.nq, problem.nk, 16, 16, "cpu")[0, 0]
    full = (states == FULL).nonzero().tolist()
    assert full == [[0, 0], [0, 2], [2, 0], [2, 2]], full


def test_rows_without_keys_case_really_has_them():
    problem, _, _ = build_case("dot_causal_rows_without_keys", torch.float64)
    assert problem.nq > problem.nk  # bottom-right causal: the first Nq - Nk rows see no key


def test_dispatch_order_and_cpu_reason():
    names = engine_names()
    assert names.index("sdpa") < names.index("triton") < names.index("fused")
    problem, _, _ = build_case("dot", torch.float32)
    assert "CUDA" in triton_engine.plan(problem)
    assert qkv.attention(problem.q, problem.k, problem.v).shape == (1, 2, 40, 24)


def _user_problem(score_mod=None, mask=None):
    q = torch.randn(1, 2, 8, 16)
    k = torch.randn(1, 2, 8, 16)
    return build_problem(q, k, k, mask=mask, score_mod=score_mod, similarity="dot", scale=None,
                         metric=None, dropout_p=0.0, return_weights=False)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize(
    ("score_mod", "mask", "expected"),
    [
        (lambda s, b, h, q, kv: s if q > kv else -s, None, "Python control flow"),
        (lambda s, b, h, q, kv: torch.erf(s), None, "torch.erf"),
        (lambda s, b, h, q, kv: s + torch.ones(4)[kv, None], None, "indexed with one integer"),
        (lambda s, b, h, q, kv: s + torch.ones(8, 8), None, "used whole"),
        (None, qkv.custom_mask(lambda b, h, q, kv: int(q) > 0), "converted to a Python number"),
    ],
)
def test_uncompilable_variants_name_the_problem(score_mod, mask, expected):
    reason = triton_engine.unsupported(_user_problem(score_mod, mask))
    assert reason is not None and expected in reason and "cannot compile" in reason


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_pairwise_terms_without_triton_code_are_traced_or_refused_with_a_reason():
    """A term the kernels have no code for is traced (even one named like a built-in); one
    the tracer cannot follow gets a reason from why_not (so the dispatcher falls back),
    never a default to another term."""
    q = torch.randn(1, 2, 8, 16)
    impostor = qkv.Similarity(lambda a, b: -(a - b).abs(), name="neg_l1")
    assert term_kind(impostor.pairwise) == TermKind.TRACED
    assert triton_engine.unsupported(build_problem(q, q, q, similarity=impostor)) is None
    branchy = qkv.Similarity(lambda a, b: a * b if a.sum() > 0 else -a * b)
    reason = triton_engine.unsupported(build_problem(q, q, q, similarity=branchy))
    assert reason is not None and "cannot compile the pairwise term" in reason, reason


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_too_many_captured_tensors_is_a_clear_error():
    tables = [torch.randn(8) for _ in range(5)]

    def mod(s, b, h, q, kv):
        for t in tables:
            s = s + t[kv]
        return s

    assert "at most 4" in triton_engine.unsupported(_user_problem(mod))


def run_compile_case(name: str) -> dict:
    """Runs in the interpreter subprocess: test_compile's case ``name`` with only the Triton
    engine in the dispatch list, eager against torch.compile(fullgraph=True)."""
    from qkv import engines

    from .test_compile import compile_errors

    triton_only = [engines.Engine("triton", lambda p: triton_engine.plan(p, on_cpu=True))]
    saved, engines.ENGINES[:] = list(engines.ENGINES), triton_only
    try:
        out_error, grad_error = compile_errors(name)
    finally:
        engines.ENGINES[:] = saved
    return {"out": out_error, "grads": grad_error}


def _without_overflow_checks() -> None:
    """Triton's interpreter checks every int32 add, sub and mul for overflow, a fifth of its
    time here; the indices of these small cases are far from 2**31 (compiled kernels check
    only in debug mode)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None and hasattr(builder.options, "sanitize_overflow"):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def _language_patched_once_per_launch() -> None:
    """Triton's interpreter patches triton.language (and its core) for each launch, and again
    at every call of a @triton.jit helper inside it (``inspect.getmembers`` over the modules,
    a sixth of its time here), keeping those patches until the process ends. Within one
    launch, a helper that sees only modules already patched skips it."""
    import triton.language as tl
    from triton.runtime import interpreter

    if not all(hasattr(interpreter, name) for name in
               ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return
    patch, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: list[set[int]] = []  # the language modules patched in each active launch

    @functools.cache
    def languages(fn) -> frozenset[int]:  # the modules _patch_lang patches for fn
        return frozenset(id(value) for value in fn.__globals__.values()
                         if inspect.ismodule(value) and value in (tl, tl.core))

    def patch_lang(fn):
        if patched and languages(fn) <= patched[-1]:
            return interpreter._LangPatchScope()
        if patched:
            patched[-1] |= languages(fn)
        return patch(fn)

    def launch_once_patched(self, *args, **kwargs):
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = launch_once_patched


def lighter_interpreter() -> None:
    """The interpreter's work these small cases do not need, skipped (each subprocess)."""
    _without_overflow_checks()
    _language_patched_once_per_launch()


if __name__ == "__main__":  # the interpreter subprocess
    lighter_interpreter()
    runs = [(case, run_case) for case in CASES]
    runs += [(f"compile_{case}", lambda c: run_compile_case(c[len("compile_"):]))
             for case in COMPILE_CASES]
    runs += [(case, run_weights_case) for case in WEIGHT_CASES]
    runs.append(("dropout", lambda _: run_dropout_case()))
    runs.append(("lse_sinks", lambda _: run_lse_sinks_case()))
    runs.append(("integer_positions", lambda _: run_integer_positions_case()))
    for case, runner in runs:
        try:
            outcome = runner(case)
        except Exception:
            outcome = {"error": traceback.format_exc()}
        print("RESULT " + json.dumps([case, outcome]), flush=True)
