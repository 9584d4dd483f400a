"""Inference-only packed linear layers: bf16 weights (the error they add, stated and bounded) and
float32 weights (the layer's own numbers)."""

import pytest
import torch
from torch import nn

import qkv.nn.packed as packed_module
from qkv.engines.cpu import cpu_flash
from qkv.nn.attention import MultiHeadAttention
from qkv.nn.packed import PackedLinear, pack_linears

from .conftest import assert_float32_linear, llama_shaped_gpt


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
        # The KV cache keeps float32 activations, so cached decoding equals the full pass
        # (with float32 attention products: the full pass's longer rows would otherwise
        # multiply in bf16, and the cached steps' single rows not).
        _set_attention_precision(model, "ieee")
        assert torch.equal(model.generate(idx, 8, temperature=0),
                           model.generate(idx, 8, temperature=0, use_cache=False))
    assert (model.generate(idx, 8, temperature=0) == greedy).float().mean() > 0.9


def _set_attention_precision(model, precision):
    for m in model.modules():
        if isinstance(m, MultiHeadAttention):
            m.fp32_precision = precision


def _attention_precisions(model):
    return {m.fp32_precision for m in model.modules() if isinstance(m, MultiHeadAttention)}


@pytest.mark.parametrize("dtype, precision", [(torch.bfloat16, "bf16"),
                                              (torch.float32, "ieee")])
def test_bf16_packing_lets_attention_products_round_to_bf16(small_gpt, dtype, precision):
    model, _ = small_gpt
    assert _attention_precisions(model) == {"ieee"}
    pack_linears(model, dtype)
    assert _attention_precisions(model) == {precision}


@pytest.mark.skipif(not cpu_flash.available("bf16"),
                    reason="not an AMD CPU with AVX512-BF16 (or no C compiler)")
def test_a_bf16_packed_prefill_multiplies_in_bf16_and_decoding_does_not(monkeypatch):
    model = llama_shaped_gpt(block_size=160)
    # A prompt of 130 tokens: the flash engine takes 128 query rows or more.
    idx = torch.randint(0, 64, (2, 130), generator=torch.Generator().manual_seed(1))
    pack_linears(model)
    calls = []
    kernel = cpu_flash._kernel
    monkeypatch.setattr(cpu_flash, "_kernel", lambda *a: calls.append(a[0]) or kernel(*a))
    with torch.no_grad():
        got = model(idx)
        assert calls == ["bf16", "bf16"]  # the two layers
        _set_attention_precision(model, "ieee")
        want = model(idx)
        assert ((got - want).norm() / want.norm()).item() < 1e-2
        _set_attention_precision(model, "bf16")
        calls.clear()
        model.generate(idx, 3, temperature=0)  # the prompt, then steps of one query row
    # Only the prompt's first layer: generation's last layer computes the last position alone.
    assert calls == ["bf16"]


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
