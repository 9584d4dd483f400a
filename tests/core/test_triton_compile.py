"""The Triton kernels compile for a GPU (sm_90) with the ptxas that ships with Triton: no GPU
needed. The interpreter tests check the numbers; this checks the compiled path (constexpr
branches, generated mask and score-modifier functions, tile shapes) with the exact launch
arguments the engine uses, recorded from a run on CPU tensors with the GPU tilings.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import tempfile

import pytest
import torch

import qkv
from qkv.core.problem import build_problem

from . import test_triton_weighting as weighting_cases

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

SHARED_MEMORY_PER_BLOCK = 227 * 1024  # sm_90's most for one block


class _Recorder:
    """Stands in for a kernel: records ``kernel[grid](*args, **kwargs)`` instead of launching."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _record_launches(monkeypatch, problem):
    from qkv.engines import triton as triton_engine
    from qkv.engines.triton import backward, function, kernels, weighted, weighted_backward

    choose = function.choose_tiling
    monkeypatch.setattr(function, "choose_tiling",
                        lambda kernel, d, _, size: choose(kernel, d, True, size))
    recorders = {}
    for module, name in ((kernels, "fwd_kernel"), (backward, "bwd_kv_kernel"),
                         (backward, "bwd_q_kernel"), (kernels, "weights_kernel"),
                         (kernels, "row_dots_kernel"), (weighted, "fwd_kernel"),
                         (weighted, "weights_kernel"), (weighted_backward, "bwd_kv_kernel"),
                         (weighted_backward, "bwd_q_kernel")):
        recorders[module.__name__, name] = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[module.__name__, name])
    runner = triton_engine.plan(problem, on_cpu=True)
    assert not isinstance(runner, str), runner
    if problem.return_weights:
        with torch.no_grad():
            runner()
    else:
        out = runner().out
        out.backward(torch.ones_like(out))
    return [(r.kernel, *call) for r in recorders.values() for call in r.calls]


def _compile(kernel, args, kwargs):
    """``kernel`` compiled for sm_90 as Triton's launcher compiles it for these arguments: its
    own binder specializes them (pointer and integer alignment, integers equal to 1, the
    constants inside tuple arguments), so the shared memory and the code checked here are
    what runs on the GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    try:
        from triton.runtime.jit import create_function_from_signature

        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(
            backend, kwargs, bound, specialization, options)
        source = ASTSource(kernel, signature, constexprs, attrs)
    except (ImportError, AttributeError, TypeError) as e:  # a Triton with other internals
        pytest.skip(f"Triton's launcher internals differ from 3.6-3.9's: {e}")
    return triton.compile(source, target=target, options=options.__dict__)


def _problem(similarity, mask, score_mod, dtype, d, weights, dropout_p, weighting="softmax"):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 200, d, generator=g).to(dtype).requires_grad_(not weights)
               for h in (4, 2, 2))
    return build_problem(q, k, v, mask=mask, score_mod=score_mod, similarity=similarity,
                         scale=None, metric=None, dropout_p=dropout_p, return_weights=weights,
                         weighting=weighting)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("similarity", "mask", "learned_mod", "dtype", "d", "weights", "dropout_p"),
    [
        ("dot", "causal_padding", "alibi", torch.bfloat16, 128, False, 0.1),
        ("dot", None, None, torch.float32, 128, False, 0.0),
        ("l1", None, None, torch.float32, 40, False, 0.0),
        ("l2", "causal_padding", None, torch.float16, 64, True, 0.1),
        ("laplacian", "causal_padding", None, torch.bfloat16, 64, False, 0.0),
        ("p3", None, None, torch.float32, 40, True, 0.0),
        ("weighted_l1", "causal_padding", None, torch.float16, 4, False, 0.0),
    ],
    ids=["dot-bf16-d128-causal-padding-learned-alibi-dropout", "dot-fp32-d128", "l1-fp32-d40",
         "l2-fp16-d64-weights-dropout", "user-laplacian-learned-tau-bf16-d64-causal-padding",
         "user-p3-fp32-d40-weights", "user-weighted-l1-per-dim-grads-fp16-d4"],
)
def test_kernels_compile_for_sm90(
    monkeypatch, similarity, mask, learned_mod, dtype, d, weights, dropout_p
):
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.6's default, stated (3.9 warns)
    masks = {None: None, "causal_padding": qkv.causal() & qkv.padding(torch.tensor([200, 150]))}
    mod = qkv.alibi(slopes=torch.rand(4, requires_grad=True)) if learned_mod else None
    problem = _problem(similarity, masks[mask], mod, dtype, d, weights, dropout_p)
    launches = _record_launches(monkeypatch, problem)
    expected = ["fwd_kernel", "weights_kernel"] if weights else [
        "fwd_kernel", "bwd_kv_kernel", "bwd_q_kernel"
    ]
    # Row dots: L2's squared norms (q's and k's, in each of the two passes) and the
    # backward's delta = rowsum(dO * O).
    expected += ["row_dots_kernel"] * ((4 if similarity == "l2" else 0) + (0 if weights else 1))
    assert [kernel.fn.__name__ for kernel, _, _ in launches] == expected
    for kernel, args, kwargs in launches:
        compiled = _compile(kernel, args, kwargs)
        assert compiled.asm["cubin"], kernel.fn.__name__
        # Else the launch fails on the GPU (out of resources), not here.
        assert compiled.metadata.shared <= SHARED_MEMORY_PER_BLOCK, kernel.fn.__name__


def _weighting(name: str):
    """test_triton_weighting.py's weighting ``name``, its learnable tensors made for 4 heads."""
    leaves = {n: make(4).requires_grad_() for n, make in weighting_cases._LEAVES.items()}
    return weighting_cases._weighting(name, leaves)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("weighting", "mask", "dtype", "d", "weights", "dropout_p"),
    [
        ("sigmoid_bias", "causal_padding", torch.bfloat16, 128, False, 0.1),
        ("identity", None, torch.float16, 40, True, 0.0),
        ("elementwise", "causal_padding", torch.bfloat16, 64, False, 0.0),
        ("softpick", "causal_padding", torch.bfloat16, 128, False, 0.0),
        ("stick_self", "causal", torch.bfloat16, 128, False, 0.1),
        ("stick", "causal", torch.float16, 64, True, 0.0),
    ],
    ids=["sigmoid-learned-bias-bf16-d128-causal-padding-dropout", "identity-fp16-d40-weights",
         "user-learned-gain-bf16-d64-causal-padding", "softpick-bf16-d128-causal-padding",
         "stick-include-self-bf16-d128-dropout", "stick-fp16-d64-weights"],
)
def test_weighting_kernels_compile_for_sm90(monkeypatch, weighting, mask, dtype, d, weights,
                                            dropout_p):
    """The kernels of ``weighted.py`` and ``weighted_backward.py`` (every weighting but
    softmax), as launched: stick-breaking's backward runs by query tiles only. float32 takes
    softmax's tilings, which the cases above compile; its loops (products on CUDA cores)
    are the slowest to compile."""
    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    masks = {None: None, "causal": qkv.causal(),
             "causal_padding": qkv.causal() & qkv.padding(torch.tensor([200, 150]))}
    problem = _problem("dot", masks[mask], None, dtype, d, weights, dropout_p,
                       _weighting(weighting))
    launches = _record_launches(monkeypatch, problem)
    stick = weighting.startswith("stick")
    # In the recorders' order: the backward's delta (row dots) first, then weighted.py's.
    expected = ["fwd_kernel", "weights_kernel"] if weights else [
        "row_dots_kernel", "fwd_kernel", *([] if stick else ["bwd_kv_kernel"]), "bwd_q_kernel"]
    assert [kernel.fn.__name__ for kernel, _, _ in launches] == expected
    for kernel, args, kwargs in launches:
        if kernel.fn.__name__ != "row_dots_kernel":
            assert kernel.fn.__module__.endswith(("weighted", "weighted_backward")), kernel.fn
        compiled = _compile(kernel, args, kwargs)
        assert compiled.asm["cubin"], kernel.fn.__name__
        assert compiled.metadata.shared <= SHARED_MEMORY_PER_BLOCK, (
            kernel.fn.__name__, compiled.metadata.shared)


def _sass(compiled) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    if not os.path.exists(tool):
        pytest.skip("this Triton ships no nvdisasm")
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([tool, "-c", path], capture_output=True, text=True,
                              check=True).stdout


def innermost_loops(sass: str) -> list[int]:
    """Instructions (NOPs aside) of each innermost loop of disassembled SASS, in program
    order: a loop runs from a label to the last branch back to it."""
    instructions, labels, pending = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        found = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if found:
            labels.update((name, len(instructions)) for name in pending)
            pending = []
            instructions.append(found.group(1).strip())
    loops = {}
    for i, text in enumerate(instructions):
        target = re.search(r"\bBRA\b.*?\.(L_x_\d+)", text)
        if target and labels.get(target.group(1), i + 1) <= i:
            loops[labels[target.group(1)]] = i
    spans = sorted(loops.items())
    inner = [(a, b) for a, b in spans if not any(a < c and d <= b for c, d in spans)]
    return [sum(not t.startswith("NOP") for t in instructions[a:b + 1]) for a, b in inner]


# The counted loop: the full tiles of a row (or column) that follow each other, which the
# kernels count instead of looking up. Each kernel has three tile loops, in this order: the
# partial tiles, the counted full tiles, the full tiles looked up in the block table (a
# one-instruction loop after them is the trap at the end of the code). Ceilings per Triton
# version: the SASS of the counted loop, bf16, D = 128, causal mask, as the engine launches
# it; what one score costs on the GPU's tensor-core path.
LOOP_CEILINGS = {
    "3.6": {"dot": {"fwd_kernel": 385, "bwd_kv_kernel": 789, "bwd_q_kernel": 330},
            "alibi": {"fwd_kernel": 514, "bwd_kv_kernel": 843, "bwd_q_kernel": 717},
            "sigmoid": {"fwd_kernel": 424, "bwd_kv_kernel": 680, "bwd_q_kernel": 587},
            "softpick": {"fwd_kernel": 774, "bwd_kv_kernel": 1567, "bwd_q_kernel": 586}},
    "3.9": {"dot": {"fwd_kernel": 405, "bwd_kv_kernel": 572, "bwd_q_kernel": 367},
            "alibi": {"fwd_kernel": 550, "bwd_kv_kernel": 770, "bwd_q_kernel": 722},
            # weighted.py's kernels (stick-breaking's have one loop: nothing is counted)
            "sigmoid": {"fwd_kernel": 445, "bwd_kv_kernel": 730, "bwd_q_kernel": 624},
            "softpick": {"fwd_kernel": 793, "bwd_kv_kernel": 1302, "bwd_q_kernel": 623}},
}
WEIGHTED_LOOPS = ("sigmoid", "softpick")


def full_tile_loops(monkeypatch, score_mod, weighting="softmax") -> dict[str, int]:
    """Instructions of the counted full-tile loop of the forward, dK/dV and dQ kernels for
    dot attention (bf16, D = 128, causal) with ``score_mod`` and ``weighting``, compiled as
    launched."""
    problem = _problem("dot", qkv.causal(), score_mod, torch.bfloat16, 128, False, 0.0,
                       weighting)
    counts = {}
    for kernel, args, kwargs in _record_launches(monkeypatch, problem):
        if kernel.fn.__name__ == "row_dots_kernel":
            continue
        loops = [n for n in innermost_loops(_sass(_compile(kernel, args, kwargs))) if n > 1]
        assert len(loops) == 3, (kernel.fn.__name__, loops)
        counts[kernel.fn.__name__] = loops[1]
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("mod", ["dot", "alibi", *WEIGHTED_LOOPS])
def test_full_tile_loops_take_no_more_instructions(monkeypatch, mod):
    import triton

    pytest.importorskip("triton.backends.nvidia")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")
    version = ".".join(triton.__version__.split(".")[:2])
    if mod not in LOOP_CEILINGS.get(version, {}):
        pytest.skip(f"no instruction counts recorded for {mod} with Triton {version}")
    score_mod = qkv.alibi(slopes=torch.rand(4, requires_grad=True)) if mod == "alibi" else None
    counts = full_tile_loops(monkeypatch, score_mod,
                             mod if mod in WEIGHTED_LOOPS else "softmax")
    print(f"Triton {version}, {mod}: {counts}")
    ceilings = LOOP_CEILINGS[version][mod]
    assert all(counts[name] <= ceilings[name] for name in ceilings), (counts, ceilings)
