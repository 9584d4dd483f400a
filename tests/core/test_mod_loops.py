"""The score modifier's C loops: the backward keeps d mod / d score from its recompute (one
evaluation per pair) exactly when no tensor the modifier reads needs a gradient; the inline
tanh and exp the generated C calls are as exact as they say; integer and bool tensors the
modifier reads are read as they are."""

import ctypes

import pytest
import torch

import qkv
from qkv.core.scores import UserScoreMod
from qkv.engines.cpu import native
from qkv.engines.kernelgen import c_mod, c_text

# The modifier's C loops exist only where the C kernels build; without them it runs on torch
# (test_native_fallback.py).
needs_c = pytest.mark.skipif(not native.available(torch.float32), reason="no C compiler")


@needs_c
def test_the_slope_is_kept_only_without_tensor_gradients():
    assert c_mod.traced_mod(qkv.softcap(30.0), torch.float32).keeps_slope
    learnable = torch.tensor(30.0, requires_grad=True)
    assert not c_mod.traced_mod(qkv.softcap(learnable), torch.float32).keeps_slope
    # ALiBi's derivative does not read the score: nothing to keep.
    assert not c_mod.traced_mod(qkv.alibi(4), torch.float32).keeps_slope


def test_kept_slope_gives_the_reference_gradients():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 77, 16, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    grads = []
    for backend in ("fused", "reference"):
        out = qkv.attention(q, k, v, score_mod=qkv.softcap(5.0), mask=qkv.causal(),
                            scale=0.3, backend=backend)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
    for fused, reference in zip(*grads, strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-10, atol=1e-12)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_integer_and_bool_tensors_are_read_as_they_are(dtype):
    """Document ids (int64), a bucket table (int32) into a learnable float bias, and a bool
    flag per key: the modifier gets C loops, and the reference's values and gradients."""
    n = 45
    docs = torch.arange(n) // 10
    buckets = (torch.arange(2 * n - 1) - (n - 1)).abs().clamp(max=7).to(torch.int32)
    flag = torch.arange(n) % 3 == 0
    bias = torch.linspace(-1, 1, 8, dtype=dtype).requires_grad_()

    def mod(s, b, h, q, kv):
        return s + bias[buckets[q - kv + n - 1]] - 2.0 * (docs[q] != docs[kv]) + 0.5 * flag[kv]

    assert c_mod.traced_mod(UserScoreMod(mod), dtype) is not None
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64).to(dtype).requires_grad_()
               for _ in range(3))
    grads = []
    for backend in ("fused", "reference"):
        out = qkv.attention(q, k, v, score_mod=UserScoreMod(mod), backend=backend)
        grads.append((out, *torch.autograd.grad((out * out).sum(), (q, k, v, bias))))
    tolerance = {"rtol": 1e-10, "atol": 1e-12} if dtype == torch.float64 else {}
    for fused, reference in zip(*grads, strict=True):
        torch.testing.assert_close(fused, reference, **tolerance)


def _inline_math():
    """qkv_tanhf and qkv_expf of the generated C header, applied to a float tensor."""
    source = c_text.HEADER + """
void tanh_all(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = qkv_tanhf(x[i]);
}
void exp_all(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = qkv_expf(x[i]);
}
"""
    lib = native.compile_library(source, "inline_math_test")
    if lib is None:
        pytest.skip("no C compiler")

    def apply(name, x):
        y = torch.empty_like(x)
        getattr(lib, name)(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()),
                           ctypes.c_int64(x.numel()))
        return y

    return apply


def _floats_below(limit: float, step: int) -> torch.Tensor:
    """Every ``step``-th float of magnitude below ``limit``, both signs."""
    top = torch.tensor(limit, dtype=torch.float32).view(torch.int32).item()
    bits = torch.arange(0, top, step, dtype=torch.int32)
    x = bits.view(torch.float32)
    return torch.cat([x, -x])


def _ulps(y: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|y - exact| in units of the last place of exact rounded to float."""
    rounded = exact.float()
    ulp = (torch.nextafter(rounded.abs(), torch.tensor(float("inf"))) - rounded.abs()).double()
    return (y.double() - exact).abs() / ulp


def test_inline_tanh_is_correctly_rounded_but_for_ties():
    apply = _inline_math()
    x = _floats_below(11.0, 1021)
    y = apply("tanh_all", x)
    errors = _ulps(y, torch.tanh(x.double()))
    assert errors.max() < 0.51
    assert (y != torch.tanh(x.double()).float()).double().mean() < 1e-4
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 20.0,
                            -3e38])
    y = apply("tanh_all", special)
    assert y[0].isnan() and y[1:].tolist() == [1.0, -1.0, 0.0, -0.0, special[5].item(), 1.0,
                                               -1.0]
    assert torch.signbit(y[4])


def test_inline_exp_is_within_two_ulps():
    apply = _inline_math()
    x = torch.linspace(-87.3, 88.7, 1_000_003)
    errors = _ulps(apply("exp_all", x), torch.exp(x.double()))
    assert errors.max() <= 2.0
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), -100.0, 100.0])
    y = apply("exp_all", special)
    assert y[0].isnan() and y[1:].tolist() == [float("inf"), 0.0, 0.0, float("inf")]


def test_inline_int64_to_double_is_the_cast():
    """qkv_i64_to_f64 (generated C's vectorizable cast) equals (double)x for every int64:
    exact up to 2^53, correctly rounded beyond; and (float) of it is (float)x up to 2^53."""
    source = c_text.HEADER + """
void convert_all(const int64_t *x, double *y, float *z, int64_t n) {
    for (int64_t i = 0; i < n; i++) { y[i] = qkv_i64_to_f64(x[i]); z[i] = (float)y[i]; }
}
"""
    lib = native.compile_library(source, "int64_cast_test")
    if lib is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(0)
    edges = [0, 1, -1, 2**31 - 1, -2**31, 2**31, 2**32 - 1, 2**32, -2**32, 2**53, -2**53,
             2**53 + 1, 2**62 + 2**10 + 1, 2**63 - 1, -2**63, -(2**63 - 1)]
    x = torch.cat([torch.tensor(edges, dtype=torch.int64),
                   torch.randint(-2**63, 2**63 - 1, (100_000,), generator=g, dtype=torch.int64),
                   torch.randint(-2**40, 2**40, (100_000,), generator=g, dtype=torch.int64)])
    y, z = torch.empty(x.shape, dtype=torch.float64), torch.empty(x.shape)
    lib.convert_all(*(ctypes.c_void_p(t.data_ptr()) for t in (x, y, z)),
                    ctypes.c_int64(x.numel()))
    assert torch.equal(y, x.double())
    small = x.abs() <= 2**53
    assert torch.equal(z[small], x[small].float())


def test_a_modifier_that_does_not_trace_warns_with_the_cause_and_stays_exact():
    from .conftest import rand_qkv, rel_err

    if not native.available(torch.float64):
        pytest.skip("no C compiler")
    q, k, v = rand_qkv(h=2, hkv=2, nq=9, nk=9, d=4, dv=3)

    def erf_mod(s, b, h, qi, ki):
        return torch.special.erf(s)

    with pytest.warns(RuntimeWarning, match="does not trace to C.*special_erf"):
        got = qkv.attention(q, k, v, score_mod=erf_mod, backend="fused")
    want = qkv.attention(q, k, v, score_mod=erf_mod, backend="reference")
    assert rel_err(got, want) < 1e-12
