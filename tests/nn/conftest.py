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
