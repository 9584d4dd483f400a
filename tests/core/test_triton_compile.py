"""The Triton kernels compile for a GPU (sm_90) with the ptxas that ships with Triton: no GPU
needed. The interpreter tests check the numbers; this checks the compiled path (constexpr
branches, generated mask and score-modifier functions, tile shapes) with the exact launch
arguments the engine uses, recorded from a run on CPU tensors with the GPU tilings.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import qkv
from qkv.core.problem import build_problem

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed"
)

_POINTER_TYPES = {torch.float64: "*fp64", torch.float32: "*fp32", torch.bfloat16: "*bf16",
                  torch.float16: "*fp16", torch.int32: "*i32", torch.int64: "*i64",
                  torch.uint8: "*u8"}
_LAUNCH_OPTIONS = ("num_warps", "num_stages")
SHARED_MEMORY_PER_BLOCK = 227 * 1024  # sm_90's most for one block


class _Recorder:
    """Stands in for a kernel: records ``kernel[grid](*args, **kwargs)`` instead of launching."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


def _record_launches(monkeypatch, problem):
    from qkv.engines import triton as triton_engine
    from qkv.engines.triton import backward, function, kernels

    choose = function.choose_tiling
    monkeypatch.setattr(function, "choose_tiling",
                        lambda kernel, d, _, size: choose(kernel, d, True, size))
    recorders = {}
    for module, name in ((kernels, "fwd_kernel"), (backward, "bwd_kv_kernel"),
                         (backward, "bwd_q_kernel"), (kernels, "weights_kernel"),
                         (kernels, "row_dots_kernel")):
        recorders[name] = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
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
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs = {k: v for k, v in kwargs.items() if k not in _LAUNCH_OPTIONS}
    positional = dict(zip(kernel.arg_names, args, strict=False))
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = positional.get(name)
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = _POINTER_TYPES[value.dtype]
        else:
            signature[name] = "i32"
        # As Triton's launcher specializes: a pointer or an int divisible by 16 is marked so.
        # Without it, loads stay 2-byte scalars and no copy is pipelined, so the shared memory
        # and the code checked here would not be what runs on the GPU.
        aligned = value.data_ptr() if isinstance(value, torch.Tensor) else value
        if name not in constexprs and isinstance(aligned, int) and aligned and aligned % 16 == 0:
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = {k: kwargs[k] for k in _LAUNCH_OPTIONS}
    try:
        source = ASTSource(kernel, signature, constexprs, attrs)
    except TypeError as e:  # a Triton whose internal compile API differs from 3.x's
        pytest.skip(f"triton.compiler.ASTSource has another signature: {e}")
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def _problem(similarity, mask, score_mod, dtype, d, weights, dropout_p):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 200, d, generator=g).to(dtype).requires_grad_(not weights)
               for h in (4, 2, 2))
    return build_problem(q, k, v, mask=mask, score_mod=score_mod, similarity=similarity,
                         scale=None, metric=None, dropout_p=dropout_p, return_weights=weights)


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
