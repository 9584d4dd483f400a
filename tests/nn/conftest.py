"""Fixtures shared by the layer tests."""

import pytest
import torch

from qkv.models import GPT, GPTConfig


def llama_shaped_gpt(block_size: int = 32) -> GPT:
    """A 2-layer LLaMA-shaped GPT (RMSNorm, SwiGLU, RoPE, grouped heads, no biases, 64
    tokens) in eval mode, initialized from seed 0."""
    torch.manual_seed(0)
    block = {"n_head": 4, "d_model": 64, "n_kv_head": 2, "norm": "rmsnorm", "ffn": "swiglu",
             "bias": False}
    return GPT(GPTConfig(vocab_size=64, block_size=block_size, n_layer=2, block=block,
                         positions={"kind": "rope"})).eval()


@pytest.fixture
def small_gpt():
    """``llama_shaped_gpt()`` and token ids (2, 12) for it."""
    model = llama_shaped_gpt()
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
