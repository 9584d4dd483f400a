"""The Triton engine's weightings other than softmax (sigmoid, relu, identity, a user's
elementwise function, softpick, stick-breaking) against the float64 reference: outputs and
every gradient, under masks, grouped heads, Nq != Nk (stick-breaking under a KV cache),
a learnable sigmoid bias, dropout and recomputed weights.

As in test_triton_engine.py, the kernels run in Triton's interpreter (TRITON_INTERPRET=1,
fp32), which must be on before Triton is imported: the cases run once in a subprocess (this
file run as a script) and each test checks its own case's result.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import traceback

import pytest
import torch

import qkv
from qkv import weighting as W
from qkv.core.problem import build_problem
from qkv.core.reference import expand_kv_heads, reference_attention
from qkv.engines import triton as triton_engine

from .test_triton_engine import _relative_error, lighter_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = 1e-5  # relative error of fp32 kernels vs float64, forward and gradients
# Stick-breaking's key gradients sum the rows' carries (δ less the nearer keys' Σ g) in fp32.
STICK_GRAD_TOLERANCE = 3e-5


def _bias(heads: int) -> torch.Tensor:
    return torch.linspace(-2.0, 0.5, heads)


def _scaled_tanh(gain):
    return lambda s: torch.tanh(s / 4) * gain


# Learnable tensors a case's weighting or modifier reads: name -> maker of their values.
_LEAVES = {"bias": _bias, "gain": lambda heads: torch.tensor(1.5),
           "slopes": lambda heads: torch.linspace(0.2, 0.8, heads)}


def _weighting(name: str, leaves: dict):
    return {
        "sigmoid": W.sigmoid,
        "sigmoid_bias": lambda: W.sigmoid(leaves.get("bias")),
        "relu": W.relu,
        "identity": W.identity,
        "elementwise": lambda: W.elementwise(_scaled_tanh(leaves.get("gain"))),
        "softpick": W.softpick,
        "stick": W.stick_breaking,
        "stick_self": lambda: W.stick_breaking(include_self=True),
    }[name]()


def _mask(name: str | None, batch: int, nk: int, device="cpu"):
    lengths = torch.tensor([nk - 5, 9][:batch], device=device)
    return {
        None: lambda: None,
        "causal": qkv.causal,
        "sliding": lambda: qkv.sliding_window(5, 3),
        # 40 back and none ahead: partial tiles at both ends of a row, full ones between.
        "window": lambda: qkv.sliding_window(40),
        "padding": lambda: qkv.padding(lengths),
        "causal_padding": lambda: qkv.causal() & qkv.padding(lengths),
    }[name]()


# name -> (weighting, mask, similarity, score_mod, leaves, shape (B, H, Hkv, Nq, Nk, D, Dv)).
# Tiles are 16 x 16 in the interpreter, so 24 and 40 leave ragged last tiles.
CASES = {
    "sigmoid_causal_gqa_kv_cache": ("sigmoid", "causal", "dot", None, (), (1, 4, 2, 24, 40, 16, 8)),
    "sigmoid_learnable_bias_l2_padding": ("sigmoid_bias", "padding", "l2", None, ("bias",),
                                          (2, 2, 1, 24, 24, 8, 8)),
    "relu_sliding": ("relu", "sliding", "dot", None, (), (1, 2, 1, 40, 40, 16, 8)),
    "identity_cosine": ("identity", None, "cosine", None, (), (1, 2, 2, 24, 40, 16, 8)),
    "elementwise_learnable_gain_l1_alibi": ("elementwise", "causal", "l1", "alibi",
                                            ("gain", "slopes"), (1, 2, 1, 24, 24, 8, 8)),
    "softpick": ("softpick", None, "dot", None, (), (1, 2, 1, 24, 40, 16, 8)),
    "softpick_causal_rows_without_keys": ("softpick", "causal", "dot", "alibi", ("slopes",),
                                          (1, 4, 2, 40, 24, 16, 8)),
    "softpick_cosine_padding": ("softpick", "padding", "cosine", None, (),
                                (2, 2, 1, 24, 40, 8, 8)),
    "softpick_scores_near_0": ("softpick", "causal", "dot", None, (), (1, 2, 1, 24, 40, 16, 8)),
    "stick_causal_gqa_kv_cache": ("stick", "causal", "dot", None, (), (1, 4, 2, 24, 40, 16, 8)),
    "stick_self_window": ("stick_self", "window", "dot", None, (), (1, 2, 1, 64, 64, 16, 8)),
    "stick_l2_causal_padding_alibi": ("stick", "causal_padding", "l2", "alibi", ("slopes",),
                                      (2, 2, 1, 40, 40, 8, 8)),
    "stick_decode_one_query": ("stick", None, "dot", None, (), (1, 2, 1, 1, 37, 16, 16)),
}
# Scores of a few 1e-3 (q·k of D = 16 unit normals, scaled), where e^s - e^0 keeps 4 of
# float32's 7 digits: e^s - 1 from its series below |s| = 1/4 keeps them all.
SCALES = {"softpick_scores_near_0": 5e-4}
WEIGHT_CASES = ("sigmoid_causal_gqa_kv_cache", "softpick_causal_rows_without_keys",
                "stick_self_window")
DROPOUT_CASES = ("sigmoid_learnable_bias_l2_padding", "stick_causal_gqa_kv_cache")


def build_case(name: str, dtype: torch.dtype, dropout_p: float = 0.0,
               return_weights: bool = False, device="cpu",
               values_in: torch.dtype | None = None):
    """The case's problem in ``dtype`` on ``device`` (values drawn in float32), its
    differentiable inputs and an upstream gradient. ``values_in`` rounds every drawn value
    through that dtype first, so that a float64 reference sees exactly the values a bf16 or
    fp16 run gets."""
    weighting, mask, similarity, score_mod, names, (b, h, hkv, nq, nk, d, dv) = CASES[name]
    g = torch.Generator().manual_seed(0)

    def place(t: torch.Tensor) -> torch.Tensor:
        return t.to(values_in or dtype).to(device=device, dtype=dtype)

    q, k, v = (place(torch.randn(*shape, generator=g)).requires_grad_()
               for shape in ((b, h, nq, d), (b, hkv, nk, d), (b, hkv, nk, dv)))
    leaves = {n: place(_LEAVES[n](h)).requires_grad_() for n in names}
    problem = build_problem(
        q, k, v, mask=_mask(mask, b, nk, device), similarity=similarity,
        score_mod=qkv.alibi(slopes=leaves["slopes"]) if score_mod == "alibi" else None,
        scale=SCALES.get(name),
        weighting=_weighting(weighting, leaves), dropout_p=dropout_p,
        return_weights=return_weights)
    grad_out = place(torch.randn(b, h, nq, dv, generator=torch.Generator().manual_seed(9)))
    return problem, [q, k, v, *leaves.values()], grad_out


def _run_triton(problem):
    runner = triton_engine.plan(problem, on_cpu=True)
    assert not isinstance(runner, str), runner
    return runner()


def run_case(name: str, device="cpu", dtype=torch.float32) -> dict:
    """Errors of output and every gradient vs float64 (in the interpreter subprocess, or on
    CUDA by test_triton_cuda.py, where bf16 and fp16 runs meet a reference on their rounded
    values)."""
    problem, inputs, grad_out = build_case(name, dtype, device=device)
    out = _run_triton(problem).out
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_problem, ref_inputs, _ = build_case(name, torch.float64, values_in=dtype)
    ref = reference_attention(ref_problem)[0]
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double().cpu())
    out, grads = out.cpu(), [t.cpu() for t in grads]
    empty = ref.abs().amax(-1) == 0
    return {
        "out": _relative_error(out, ref),
        "grads": [_relative_error(a, r) for a, r in zip(grads, ref_grads, strict=True)],
        # A learnable bias, gain or slope sums its gradient over every pair of its head.
        "scalar": [i >= 3 for i in range(len(inputs))],
        "empty_rows": int(empty.sum()),
        "all_rows": empty.numel(),
        "empty_rows_exact": bool((out[empty] == 0).all() and (grads[0][empty] == 0).all()),
    }


def run_weights_case(name: str) -> dict:
    with torch.no_grad():
        result = _run_triton(build_case(name, torch.float32, return_weights=True)[0])
        _, ref_weights, _ = reference_attention(build_case(name, torch.float64,
                                                           return_weights=True)[0])
    return {"weights": _relative_error(result.weights, ref_weights)}


def run_dropout_case(name: str, dropout_p: float = 0.3) -> dict:
    """Dropout draws its own numbers, so the reference reuses the kernels' keep mask, read
    from the weights of a run with the same seed: out and gradients then match float64."""
    torch.manual_seed(7)
    with torch.no_grad():
        weights = _run_triton(build_case(name, torch.float32, dropout_p, True)[0]).weights
    torch.manual_seed(7)
    problem, inputs, grad_out = build_case(name, torch.float32, dropout_p)
    out = _run_triton(problem).out
    grads = torch.autograd.grad(out, inputs, grad_out)
    ref_problem, ref_inputs, _ = build_case(name, torch.float64, return_weights=True)
    _, ref_weights, _ = reference_attention(ref_problem)
    kept = (weights != 0) | (ref_weights == 0)
    dropped = ref_weights * kept / (1 - dropout_p)
    ref = dropped @ expand_kv_heads(ref_inputs[2], problem.heads)
    ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.double())
    return {
        "kept": kept[ref_weights != 0].double().mean().item(),
        "out": _relative_error(out, ref),
        "grads": [_relative_error(a, r) for a, r in zip(grads, ref_grads, strict=True)],
    }


@pytest.fixture(scope="module")
def interpreter_results():
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-m", "tests.core.test_triton_weighting"], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root)
    results = {}
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            name, result = json.loads(line[len("RESULT "):])
            results[name] = result
    if not results:
        pytest.fail(f"the interpreter subprocess produced no results:\n{done.stderr[-4000:]}")
    return results


def _grad_tolerance(name: str) -> float:
    return STICK_GRAD_TOLERANCE if name.startswith("stick") else TOLERANCE


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", list(CASES))
def test_weighting_matches_float64_forward_and_gradients(interpreter_results, name):
    result = interpreter_results[name]
    assert "error" not in result, result["error"]
    assert result["empty_rows"] < result["all_rows"], "a case whose weights are all 0"
    assert result["out"] < TOLERANCE, result
    assert max(result["grads"]) < _grad_tolerance(name), result
    assert result["empty_rows_exact"], "rows with no allowed key must give exact zeros"


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_cases_have_rows_without_keys(interpreter_results):
    assert interpreter_results["softpick_causal_rows_without_keys"]["empty_rows"] > 0
    assert interpreter_results["stick_causal_gqa_kv_cache"]["empty_rows"] == 0  # offset 16
    assert interpreter_results["stick_self_window"]["empty_rows"] == 0  # include_self
    assert interpreter_results["stick_l2_causal_padding_alibi"]["empty_rows"] > 0  # query 0


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", WEIGHT_CASES)
def test_recomputed_weights_match_float64(interpreter_results, name):
    result = interpreter_results[f"weights_{name}"]
    assert "error" not in result, result["error"]
    assert result["weights"] < TOLERANCE, result


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("name", DROPOUT_CASES)
def test_dropout_matches_float64_with_the_kernels_keep_mask(interpreter_results, name):
    result = interpreter_results[f"dropout_{name}"]
    assert "error" not in result, result["error"]
    assert abs(result["kept"] - 0.7) < 0.1, result  # dropout_p = 0.3
    assert result["out"] < TOLERANCE and max(result["grads"]) < _grad_tolerance(name), result


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_weightings_without_kernels_are_refused_naming_them():
    class Tempered(W.Softpick):
        """A subclass is its own weighting: it has no kind, whatever it inherits."""

    q = torch.randn(1, 2, 8, 16)
    reason = triton_engine.unsupported(build_problem(q, q, q, weighting=Tempered()))
    assert reason is not None and "softpick" in reason and "no loop" in reason, reason
    stick = build_problem(q, q, q, mask=qkv.causal(), similarity="l1",
                          weighting="stick_breaking")
    reason = triton_engine.unsupported(stick)
    assert reason is not None and "stick" in reason and "l1" in reason.lower(), reason
    for name in ("sigmoid", "relu", "identity", "softpick"):
        assert triton_engine.unsupported(build_problem(q, q, q, weighting=name)) is None


if __name__ == "__main__":  # the interpreter subprocess
    lighter_interpreter()
    runs = [(case, run_case) for case in CASES]
    runs += [(f"weights_{case}", lambda c: run_weights_case(c[len("weights_"):]))
             for case in WEIGHT_CASES]
    runs += [(f"dropout_{case}", lambda c: run_dropout_case(c[len("dropout_"):]))
             for case in DROPOUT_CASES]
    for case, runner in runs:
        try:
            outcome = runner(case)
        except Exception:
            outcome = {"error": traceback.format_exc()}
        print("RESULT " + json.dumps([case, outcome]), flush=True)
