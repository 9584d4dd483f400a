"""Inference-only packed linear layers: bf16 weights (the error they add, stated and bounded) and
float32 weights (the layer's own numbers)."""

import pytest
import torch
from torch import nn

import qkv.nn.packed as packed_module
from qkv.nn.packed import PackedLinear, pack_linears

from .conftest import assert_float32_linear


def bf16_reference(x, linear):
    """What PackedLinear computes, in float64: bf16-rounded input and weight, exact sums."""
    xr = x.to(torch.bfloat16).double()
    wr = linear.weight.detach().to(torch.bfloat16).double()
    y = xr @ wr.T
    return y if linear.bias is None else y + linear.bias.detach().double()


@pytest.mark.parametrize("rows", [1, 3, 8, 130])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_bf16_weights_with_float_accumulation(rows, bias):
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40, bias=bias)
    x = torch.randn(2, rows, 96)
    packed = PackedLinear(linear)
    y = packed(x)
    assert y.shape == (2, rows, 40) and y.dtype == torch.float32
    ref = bf16_reference(x, linear)
    # Only the output's rounding to bf16 inside oneDNN (at most 2^-8 relative) may remain.
    assert ((y.double() - ref).norm() / ref.norm()).item() < 4e-3
    exact = linear(x).double()
    rel = ((y.double() - exact).norm() / exact.norm()).item()
    assert 1e-5 < rel < 1e-2  # the error bf16 adds: visible, and bounded


def test_pack_linears_keeps_a_gpt_close_and_generating_the_same(small_gpt):
    model, idx = small_gpt
    with torch.no_grad():
        want = model(idx)
        greedy = model.generate(idx, 8, temperature=0)
    pack_linears(model)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.no_grad():
        got = model(idx)
        assert ((got - want).norm() / want.norm()).item() < 1e-2
        # The KV cache keeps float32 activations, so cached decoding equals the full pass.
        assert torch.equal(model.generate(idx, 8, temperature=0),
                           model.generate(idx, 8, temperature=0, use_cache=False))
    assert (model.generate(idx, 8, temperature=0) == greedy).float().mean() > 0.9


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("rows", [1, 8, 130])
def test_float32_packing_keeps_the_layer_s_numbers(monkeypatch, onednn, rows):
    if onednn and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch is built without oneDNN")
    monkeypatch.setattr(packed_module, "onednn_available", lambda: onednn)
    torch.manual_seed(rows)
    linear = nn.Linear(96, 40)
    packed = PackedLinear(linear, torch.float32)
    assert packed.onednn == onednn and "float32 weight" in repr(packed)
    x = torch.randn(2, rows, 96)
    with torch.no_grad():
        y = packed(x)
    assert_float32_linear(y, x, linear.weight, linear.bias)


def test_pack_linears_float32_generates_what_the_model_generates(small_gpt):
    model, idx = small_gpt
    with torch.no_grad():
        want = model(idx)
        greedy = model.generate(idx, 8, temperature=0)
    pack_linears(model, torch.float32)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    with torch.no_grad():
        got = model(idx)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert torch.equal(model.generate(idx, 8, temperature=0), greedy)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64, "bf16"])
def test_packing_refuses_other_dtypes(dtype):
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float32"):
        PackedLinear(nn.Linear(4, 4), dtype)
    with pytest.raises(ValueError, match="dtype must be torch.bfloat16 or torch.float32"):
        pack_linears(nn.Sequential(nn.Linear(4, 4)), dtype)
