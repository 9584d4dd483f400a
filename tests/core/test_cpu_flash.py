"""The flash CPU engine (inference; bf16 products in AVX512-BF16, or float32 products in
AVX-512 FMA): parity with float64 (for bf16 products, on the same bf16-rounded inputs), the
rows and layouts it must handle, and when the dispatcher takes it."""

import os
import platform

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv import engines
from qkv.core.problem import build_problem
from qkv.engines.cpu import build, cpu_flash, native


def _kernel_here(products: str) -> bool:
    """Whether the kernel with ``products`` runs on this machine once the choice of vendor is
    forced (``QKV_FLASH=1``): its parity tests run on every CPU with the instructions, Intel's
    too, so the kernel is known right there before it is measured there."""
    forced = os.environ.get("QKV_FLASH")
    os.environ["QKV_FLASH"] = "1"
    cpu_flash._library.cache_clear()
    try:
        return cpu_flash.available(products)
    finally:
        if forced is None:
            del os.environ["QKV_FLASH"]
        else:
            os.environ["QKV_FLASH"] = forced
        cpu_flash._library.cache_clear()


needs_bf16 = pytest.mark.skipif(not _kernel_here("bf16"),
                                reason="no bf16 kernel here (the flash engine's refusal says why)")
needs_fp32 = pytest.mark.skipif(not _kernel_here("fp32"),
                                reason="no fp32 kernel here (the flash engine's refusal says why)")


@pytest.fixture(autouse=True)
def any_vendor(monkeypatch):
    """Each test runs with the vendor's choice forced on (``QKV_FLASH=1``), unless it sets
    its own; ``cpu_flash._library`` is decided again before and after it, so no other test
    file sees the forced choice."""
    monkeypatch.setenv("QKV_FLASH", "1")
    library = cpu_flash._library  # a test may replace it
    library.cache_clear()
    yield
    library.cache_clear()
PRODUCTS = [pytest.param("bf16", marks=needs_bf16), pytest.param("fp32", marks=needs_fp32)]


def _inputs(batch, heads, kv_heads, nq, nk, d, dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, nq, d, generator=g)
    k = torch.randn(batch, kv_heads, nk, d, generator=g)
    v = torch.randn(batch, kv_heads, nk, dv, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _check(q, k, v, causal, products="bf16"):
    """The engine against float64. bf16 products: on the bf16-rounded q, k, v it multiplies,
    whose products are exact in float32, so the log-sum-exp matches to float32 sums and the
    output carries only the softmax weights' rounding to bf16 (2^-9 relative). float32
    products: on the inputs themselves, to float32's own bounds."""
    mask = qkv.causal() if causal else None
    with torch.no_grad():
        precision = "bf16" if products == "bf16" else "ieee"
        out, lse = qkv.attention(q, k, v, mask=mask, fp32_precision=precision,
                                 return_lse=True, backend="flash")
    bf16 = products == "bf16" or q.dtype == torch.bfloat16
    exact = [(t.to(torch.bfloat16) if bf16 else t).double() for t in (q, k, v)]
    want, want_lse = qkv.attention(*exact, mask=mask, return_lse=True, backend="reference")
    assert out.dtype == q.dtype and out.shape == want.shape
    assert lse.dtype == torch.float32
    no_key = torch.isinf(want_lse)
    assert torch.equal(torch.isinf(lse), no_key)
    assert (out.double()[no_key] == 0).all()
    assert ((lse.double() - want_lse)[~no_key].abs() < (1e-4 if bf16 else 1e-5)).all()
    scale = want.abs().max().clamp_min(1.0) if want.numel() else 1.0
    assert ((out.double() - want).abs() / scale < (1e-2 if bf16 else 1e-5)).all()


@needs_bf16
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_heads_match_float64(causal):
    _check(*_inputs(2, 6, 2, 130, 130, 64, 64, torch.float32), causal)


@needs_fp32
def test_grouped_heads_match_float64_with_float32_products():
    _check(*_inputs(2, 6, 2, 130, 130, 64, 64, torch.float32), True, "fp32")


@needs_bf16
@pytest.mark.parametrize("causal", [False, True])
def test_bf16_inputs_match_float64(causal):
    _check(*_inputs(2, 6, 2, 130, 130, 64, 64, torch.bfloat16), causal)


@pytest.mark.parametrize("products", PRODUCTS)
@pytest.mark.parametrize("shape", [
    (1, 4, 4, 137, 263, 32, 48),    # Nq < Nk: bottom-right causal; Dv not a multiple of 64
    (1, 2, 1, 170, 20, 18, 16),     # Nq > Nk: the first 150 rows have no key
    (1, 3, 3, 128, 1, 256, 256),    # the widest heads, one key
    (2, 9, 3, 300, 300, 64, 128),   # SmolLM2's grouping; Dv = 2 x 64
])
def test_shapes(products, shape):
    _check(*_inputs(*shape, torch.float32, seed=sum(shape)), True, products)


@pytest.mark.parametrize("products", PRODUCTS)
def test_strided_inputs_are_read_in_place(products):
    q, k, v = _inputs(1, 4, 2, 128, 160, 32, 32, torch.float32)
    # (B, N, H, D) memory seen as (B, H, N, D), as a model's split heads are.
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q.is_contiguous()
    _check(q, k, v, True, products)


@needs_bf16
@needs_fp32
@settings(max_examples=25, deadline=None)
@given(heads=st.sampled_from([(1, 1), (4, 2), (6, 1), (5, 5)]),
       nq=st.integers(128, 200), nk=st.integers(1, 256), d=st.sampled_from([2, 16, 40, 64]),
       dv=st.sampled_from([16, 64, 80]), causal=st.booleans(),
       case=st.sampled_from([(torch.float32, "bf16"), (torch.bfloat16, "bf16"),
                             (torch.float32, "fp32")]))
def test_any_shape_matches_float64(heads, nq, nk, d, dv, causal, case):
    dtype, products = case
    # Plain float32 attention is SDPA's (the dispatch test): float32 products are causal.
    _check(*_inputs(1, heads[0], heads[1], nq, nk, d, dv, dtype, seed=nq * nk),
           causal or products == "fp32", products)


def _engine(q, k, v, **kwargs) -> str:
    return engines.plan(build_problem(q, k, v, **kwargs)).engine


@needs_bf16
@needs_fp32
def test_dispatch_takes_it_only_for_inference_of_plain_or_causal_dot():
    q, k, v = _inputs(1, 4, 2, 128, 128, 32, 32, torch.float32)
    causal = qkv.causal()
    long_k, long_v = (torch.cat([t, t, t], 2) for t in (k, v))
    with torch.no_grad():
        assert _engine(q, k, v, mask=causal) == "flash"
        # float32 products gain only on the causal diagonal's blocks
        assert _engine(q, k, v) == "sdpa"
        assert _engine(q, long_k, long_v, mask=causal) == "sdpa"
        assert _engine(q, long_k, long_v, mask=causal, fp32_precision="bf16") == "flash"
        assert _engine(q, k, v, fp32_precision="bf16") == "flash"
        assert _engine(*(t.bfloat16() for t in (q, k, v))) == "flash"
        assert _engine(q[:, :, :100], k, v, mask=causal) == "sdpa"  # a short prompt
        assert _engine(q[:, :, :1], k, v, mask=causal) == "sdpa"  # decoding
        assert _engine(q, k, v, mask=causal, score_mod=qkv.softcap(20.0)) == "fused"
        assert _engine(q, k, v, mask=causal, similarity="l2") == "fused"
        assert _engine(q, k, v, mask=causal, scale=-0.5) == "sdpa"
        assert _engine(q.half(), k.half(), v.half(), mask=causal) == "sdpa"
    q.requires_grad_()
    assert _engine(q, k, v, mask=causal) == "sdpa"  # no backward


@needs_bf16
def test_fp32_precision_picks_the_products(monkeypatch):
    q, k, v = _inputs(1, 4, 2, 128, 128, 32, 32, torch.float32)
    used = []
    kernel = cpu_flash._kernel
    monkeypatch.setattr(cpu_flash, "_kernel", lambda *a: used.append(a[0]) or kernel(*a))
    causal = qkv.causal()
    with torch.no_grad():
        exact = qkv.attention(q, k, v, mask=causal)
        rounded = qkv.attention(q, k, v, mask=causal, fp32_precision="bf16")
        qkv.attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), mask=causal)
    assert used == ["fp32", "bf16", "bf16"]
    assert not torch.equal(exact, rounded)


def test_fp32_precision_is_checked():
    q, k, v = _inputs(1, 2, 2, 4, 4, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="fp32_precision must be one of"):
        qkv.attention(q, k, v, fp32_precision="tf32")


def test_forcing_it_where_it_cannot_run_says_why(monkeypatch):
    q, k, v = _inputs(1, 2, 2, 128, 128, 8, 8, torch.float32)
    with pytest.raises(ValueError, match="takes float32 or bf16 inputs"):
        qkv.attention(q.double(), k.double(), v.double(), backend="flash")
    # The call's own reasons, as on a machine with both kernels: every call here is refused
    # before a kernel would run.
    monkeypatch.setattr(cpu_flash, "_library", lambda products: object())
    with torch.no_grad():
        with pytest.raises(ValueError, match="Dv a multiple of 16"):
            qkv.attention(q, k, v[..., :6], mask=qkv.causal(), backend="flash")
        with pytest.raises(ValueError, match="only under a causal mask"):
            qkv.attention(q, k, v, backend="flash")
        with pytest.raises(ValueError, match="fewer than 128 query rows"):
            qkv.attention(q[:, :, :16], k, v, mask=qkv.causal(), fp32_precision="bf16",
                          backend="flash")


def test_on_other_cpus_than_amd_the_reason_comes_first(monkeypatch):
    """Measured on AMD only: elsewhere every call it could take says so, whatever else is
    wrong with it, and the dispatcher goes on to SDPA."""
    monkeypatch.setattr(build, "amd_cpu", lambda: False)
    monkeypatch.delenv("QKV_FLASH", raising=False)
    q, k, v = _inputs(1, 2, 2, 128, 128, 16, 16, torch.float32)
    with torch.no_grad():
        for call in ({}, {"mask": qkv.causal()}, {"fp32_precision": "bf16"}):
            with pytest.raises(ValueError, match="AMD CPUs only: it was measured there"):
                qkv.attention(q[:, :, :16], k, v, backend="flash", **call)
        assert _engine(q, k, v, mask=qkv.causal(), fp32_precision="bf16") == "sdpa"
        assert _engine(*(t.bfloat16() for t in (q, k, v)), mask=qkv.causal()) == "sdpa"


def test_qkv_flash_forces_the_choice_of_vendor(monkeypatch):
    """QKV_FLASH=0 turns the engine off on any CPU, QKV_FLASH=1 lets a CPU of another vendor
    run it (to measure it there), and any other value is refused with the variable's name."""
    q, k, v = _inputs(1, 2, 2, 128, 128, 16, 16, torch.float32)
    monkeypatch.setattr(build, "amd_cpu", lambda: True)
    monkeypatch.setenv("QKV_FLASH", "0")
    with torch.no_grad():
        with pytest.raises(ValueError, match="QKV_FLASH=0 turns it off"):
            qkv.attention(q, k, v, mask=qkv.causal(), backend="flash")
        assert _engine(q, k, v, mask=qkv.causal()) == "sdpa"
        monkeypatch.setenv("QKV_FLASH", "yes")
        cpu_flash._library.cache_clear()
        with pytest.raises(ValueError, match="QKV_FLASH must be 0, 1 or unset; got 'yes'"):
            qkv.attention(q, k, v, mask=qkv.causal(), backend="flash")
        monkeypatch.setattr(build, "amd_cpu", lambda: False)
        monkeypatch.setenv("QKV_FLASH", "1")
        cpu_flash._library.cache_clear()
        if cpu_flash.available("fp32"):
            assert _engine(q, k, v, mask=qkv.causal()) == "flash"
        else:  # no AVX-512 here: the reason is the build's, not the vendor's
            with pytest.raises(ValueError, match="no fp32 kernel here") as refused:
                qkv.attention(q, k, v, mask=qkv.causal(), backend="flash")
            assert "AMD" not in str(refused.value)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or not native.available(
    torch.float32), reason="builds x86 targets with the C compiler")
@pytest.mark.parametrize("target", ["x86-64-v3", "x86-64-v4"])
def test_a_build_target_without_the_instructions_says_so(monkeypatch, tmp_path,
                                                          target):
    """QKV_MARCH=x86-64-v3 has no AVX-512, x86-64-v4 no AVX512-BF16: the engine refuses
    those products with the target's name (on an AMD CPU; the build alone decides)."""
    if build.missing_features(target):
        pytest.skip(f"this CPU does not run {target}")
    monkeypatch.setattr(build, "amd_cpu", lambda: True)
    monkeypatch.setenv("QKV_MARCH", target)
    monkeypatch.setenv("QKV_CACHE", str(tmp_path))
    q, k, v = _inputs(1, 2, 2, 128, 128, 16, 16, torch.bfloat16)
    with torch.no_grad(), pytest.raises(
            ValueError, match=f"no bf16 kernel here: it needs AVX512-BF16, which -march={target}"):
        qkv.attention(q, k, v, mask=qkv.causal(), backend="flash")
    assert cpu_flash.available("fp32") == (target == "x86-64-v4")
    assert len(list(tmp_path.glob("cpu_flash_*.so"))) == 2


@needs_fp32
def test_lse_is_the_natural_log_sum_exp():
    q, k, v = _inputs(1, 2, 2, 128, 160, 16, 16, torch.float32)
    with torch.no_grad():
        _, lse = qkv.attention(q, k, v, mask=qkv.causal(), return_lse=True, backend="flash",
                               scale=0.5)
    scores = q.double() @ k.double().transpose(-1, -2) * 0.5
    scores = scores.masked_fill(torch.ones(128, 160, dtype=torch.bool).triu(33), -torch.inf)
    assert torch.allclose(lse.double(), scores.logsumexp(-1), atol=1e-5)


def test_under_compile_the_call_runs_elsewhere():
    q, k, v = _inputs(1, 4, 2, 128, 128, 16, 16, torch.bfloat16)

    def f(q, k, v):
        return qkv.attention(q, k, v, mask=qkv.causal())

    with torch.no_grad():
        if cpu_flash.available("bf16"):
            assert _engine(q, k, v, mask=qkv.causal()) == "flash"  # in eager mode
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
        want = qkv.attention(q, k, v, mask=qkv.causal(), backend="sdpa")
    assert torch.equal(got, want)
