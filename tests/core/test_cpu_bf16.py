"""The bf16 CPU engine (AVX512-BF16 products, inference): parity with float64 on the same
bf16-rounded inputs, the rows and layouts it must handle, and when the dispatcher takes it."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.core import engines
from qkv.core.engines import cpu_bf16
from qkv.core.problem import build_problem

needs_bf16 = pytest.mark.skipif(not cpu_bf16.available(),
                                reason="this CPU has no AVX512-BF16 (or no C compiler)")


def _inputs(batch, heads, kv_heads, nq, nk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, nq, d, generator=g)
    k = torch.randn(batch, kv_heads, nk, d, generator=g)
    v = torch.randn(batch, kv_heads, nk, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _check(q, k, v, causal, *, out_tol=1e-2):
    """The engine against float64 on the bf16-rounded q, k, v it multiplies: the products
    of bf16 are exact in float32, so the log-sum-exp matches to float32 sums; the output
    also carries the softmax weights' rounding to bf16 (2^-9 relative)."""
    mask = qkv.causal() if causal else None
    with torch.no_grad():
        out, lse = qkv.attention(q, k, v, mask=mask, fp32_precision="bf16", return_lse=True,
                                 backend="bf16")
    rounded = [t.to(torch.bfloat16).double() for t in (q, k, v)]
    want, want_lse = qkv.attention(*rounded, mask=mask, return_lse=True, backend="reference")
    assert out.dtype == q.dtype and out.shape == want.shape
    assert lse.dtype == torch.float32
    no_key = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), no_key)
    assert (out.double()[no_key] == 0).all()
    assert ((lse.double() - want_lse)[~no_key].abs() < 1e-4).all()
    scale = want.abs().max().clamp_min(1.0) if want.numel() else 1.0
    assert ((out.double() - want).abs() / scale < out_tol).all()


@needs_bf16
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_heads_match_float64(dtype, causal):
    _check(*_inputs(2, 6, 2, 100, 100, 64, 64, dtype), causal)


@needs_bf16
@pytest.mark.parametrize("shape", [
    (1, 4, 4, 37, 203, 32, 48),     # Nq < Nk: bottom-right causal; Dv not a multiple of 64
    (1, 2, 1, 70, 20, 18, 16),      # Nq > Nk: the first 50 rows have no key
    (1, 3, 3, 16, 1, 256, 256),     # the widest heads, one key
    (2, 9, 3, 300, 300, 64, 128),   # SmolLM2's grouping; Dv = 2 x 64
])
def test_shapes(shape):
    _check(*_inputs(*shape, torch.float32, seed=sum(shape)), causal=True)


@needs_bf16
def test_strided_inputs_are_read_in_place():
    q, k, v = _inputs(1, 4, 2, 64, 80, 32, 32, torch.float32)
    # (B, N, H, D) memory seen as (B, H, N, D), as a model's split heads are.
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    _check(q, k, v, causal=True)


@needs_bf16
@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([(1, 1), (4, 2), (6, 1), (5, 5)]),
       nq=st.integers(16, 150), nk=st.integers(1, 150), d=st.sampled_from([2, 16, 40, 64]),
       dv=st.sampled_from([16, 64, 80]), causal=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_any_shape_matches_float64(heads, nq, nk, d, dv, causal, dtype):
    _check(*_inputs(1, heads[0], heads[1], nq, nk, d, dv, dtype, seed=nq * nk), causal)


def _engine(q, k, v, **kwargs) -> str:
    return engines.plan(build_problem(q, k, v, **kwargs)).engine


@needs_bf16
def test_dispatch_takes_it_only_when_allowed():
    q, k, v = _inputs(1, 4, 2, 64, 64, 32, 32, torch.float32)
    causal = qkv.causal()
    with torch.no_grad():
        assert _engine(q, k, v, mask=causal) == "sdpa"  # float32 stays float32 by default
        assert _engine(q, k, v, mask=causal, fp32_precision="bf16") == "bf16"
        assert _engine(*(t.bfloat16() for t in (q, k, v)), mask=causal) == "bf16"
        assert _engine(q[:, :, :4], k, v, fp32_precision="bf16") == "sdpa"  # decoding's rows
        assert _engine(q, k, v, fp32_precision="bf16", score_mod=qkv.softcap(20.0)) == "fused"
        assert _engine(q, k, v, fp32_precision="bf16", similarity="l2") == "fused"
    q.requires_grad_()
    assert _engine(q, k, v, mask=causal, fp32_precision="bf16") == "sdpa"  # no backward


def test_fp32_precision_is_checked():
    q, k, v = _inputs(1, 2, 2, 4, 4, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="fp32_precision must be one of"):
        qkv.attention(q, k, v, fp32_precision="tf32")


def test_forcing_it_where_it_cannot_run_says_why():
    q, k, v = _inputs(1, 2, 2, 32, 32, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="bf16 inputs, or float32 with fp32_precision"):
        qkv.attention(q, k, v, backend="bf16")
    if cpu_bf16.available():
        with pytest.raises(ValueError, match="Dv a multiple of 16"):
            qkv.attention(q, k, v[..., :6], backend="bf16", fp32_precision="bf16")


@needs_bf16
def test_lse_is_the_natural_log_sum_exp():
    q, k, v = _inputs(1, 2, 2, 32, 48, 16, 16, torch.bfloat16)
    with torch.no_grad():
        _, lse = qkv.attention(q, k, v, return_lse=True, backend="bf16", scale=0.5)
    scores = q.double() @ k.double().transpose(-1, -2) * 0.5
    assert torch.allclose(lse.double(), scores.logsumexp(-1), atol=1e-4)
    assert not math.isnan(lse.sum().item())


def test_under_compile_the_call_runs_elsewhere():
    q, k, v = _inputs(1, 4, 2, 32, 32, 16, 16, torch.bfloat16)

    def f(q, k, v):
        return qkv.attention(q, k, v, mask=qkv.causal())

    with torch.no_grad():
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
        want = qkv.attention(q, k, v, mask=qkv.causal(), backend="sdpa")
    assert torch.equal(got, want)
