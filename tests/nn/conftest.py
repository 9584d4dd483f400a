"""Fixtures shared by the layer tests."""

import pytest
import torch

from qkv.models import GPT, GPTConfig


@pytest.fixture
def small_gpt():
    """A 2-layer LLaMA-shaped GPT (RMSNorm, SwiGLU, RoPE, grouped heads, no biases) in eval
    mode, and token ids (2, 12) for it."""
    torch.manual_seed(0)
    block = {"n_head": 4, "d_model": 64, "n_kv_head": 2, "norm": "rmsnorm", "ffn": "swiglu",
             "bias": False}
    model = GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, block=block,
                          positions={"kind": "rope"})).eval()
    return model, torch.randint(0, 64, (2, 12))


def assert_float32_linear(y, x, weight, bias):
    """y is x @ weightᵀ + bias summed in float32 in some order: within the standard bound
    n·u·Σ|x_i w_i| (u = 2^-24, n = in_features), with room for the bias's rounding, of the
    float64 product."""
    weight = weight.detach().double()
    want = x.double() @ weight.T
    terms = x.abs().double() @ weight.abs().T
    if bias is not None:
        want = want + bias.detach().double()
        terms = terms + bias.detach().abs().double()
    assert y.shape == want.shape and y.dtype == torch.float32
    bound = (x.shape[-1] + 2) * 2.0**-24 * terms
    assert ((y.double() - want).abs() <= bound).all()
