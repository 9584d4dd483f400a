"""Weight-only bf16 linear layers: the error they add, stated and bounded."""

import pytest
import torch
from torch import nn

from qkv.models import GPT, GPTConfig
from qkv.nn.packed import PackedLinear, pack_linears


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


def test_pack_linears_keeps_a_gpt_close_and_generating_the_same():
    torch.manual_seed(0)
    block = {"n_head": 4, "d_model": 64, "n_kv_head": 2, "norm": "rmsnorm", "ffn": "swiglu",
             "bias": False}
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, block=block,
                          positions={"kind": "rope"})).eval()
    idx = torch.randint(0, 64, (2, 12))
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
