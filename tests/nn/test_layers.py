"""Feed-forward, norms, blocks (post-norm and pre-norm) and the attention-kind registry."""

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.models import GPT, GPTConfig
from qkv.nn import (
    ATTENTION_KINDS,
    BlockConfig,
    MultiHeadAttention,
    RMSNorm,
    feed_forward,
    register_attention_kind,
    transformer_block,
)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu"])
def test_feedforward_formulas(activation):
    torch.manual_seed(0)
    ffn = feed_forward(activation, 6, 10)
    x = torch.randn(2, 3, 6)
    first = ffn.gate_proj if activation == "swiglu" else ffn.up_proj
    h = x @ first.weight.T + first.bias
    h = {
        "relu": lambda: h.clamp(min=0),
        "gelu": lambda: 0.5 * h * (1 + torch.erf(h / 2**0.5)),
        "gelu_tanh": lambda: 0.5 * h * (
            1 + torch.tanh((2 / torch.pi) ** 0.5 * (h + 0.044715 * h**3))
        ),
        "swiglu": lambda: F.silu(h) * (x @ ffn.up_proj.weight.T + ffn.up_proj.bias),
    }[activation]()
    assert torch.allclose(ffn(x), h @ ffn.down_proj.weight.T + ffn.down_proj.bias, atol=1e-6)
    with pytest.raises(ValueError, match="ffn must be one of"):
        feed_forward("tanh", 6, 10)


def test_rmsnorm_formula():
    norm = RMSNorm(4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.randn(3, 4)
    expected = x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * norm.weight
    assert torch.allclose(norm(x), expected, atol=1e-6)


@pytest.mark.parametrize("norm_first", [False, True])
def test_block_post_and_pre_norm(norm_first):
    torch.manual_seed(0)
    cfg = BlockConfig(d_model=8, n_head=2, d_ff=16, norm_first=norm_first, ffn="relu")
    block = transformer_block(cfg).eval()
    x = torch.randn(2, 5, 8)
    attn, ffn = block.self_attn, block.ffn
    n1, n2 = block.attn_sublayer.norm, block.ffn_sublayer.norm
    if norm_first:
        h = x + attn(n1(x))
        expected = h + ffn(n2(h))
    else:
        h = n1(x + attn(x))
        expected = n2(h + ffn(h))
    assert torch.allclose(block(x), expected, atol=1e-6)


def test_residual_dropout_only_in_training():
    torch.manual_seed(0)
    block = transformer_block(BlockConfig(d_model=8, n_head=2, d_ff=16, dropout=0.5,
                                          norm_first=False, ffn="relu"))
    x = torch.randn(2, 5, 8)
    assert not torch.allclose(block(x), block(x))
    block.eval()
    assert torch.equal(block(x), block(x))


class ScaledSoftmax(MultiHeadAttention):
    """A stand-in kind: softmax attention with a different temperature."""


def test_registered_kind_is_built_by_config_string():
    built = []

    def factory(*, d_model, n_head, n_kv_head, bias, dropout, similarity, weighting, rope,
                is_cross, depth, forget_gate):
        built.append(ScaledSoftmax(d_model, n_head, n_kv_head=n_kv_head, bias=bias, scale=0.1,
                                   rope=rope, is_cross=is_cross))
        return built[-1]

    block = {"n_head": 2, "d_model": 8, "attention": "scaled-test"}
    register_attention_kind("scaled-test", factory)
    try:
        model = GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=2, block=block))
        kinds = [m for m in model.modules() if isinstance(m, ScaledSoftmax)]
        assert kinds == built and len(built) == 2  # the builder is called once per layer
        model.generate(torch.tensor([[1, 2]]), 3, temperature=0)
    finally:
        del ATTENTION_KINDS["scaled-test"]
    with pytest.raises(ValueError, match="attention: expected one of"):
        GPTConfig(vocab_size=20, block_size=8, n_layer=2, block=block)


def test_score_modifiers_pass_through_blocks():
    torch.manual_seed(0)
    cfg = BlockConfig(d_model=8, n_head=2, d_ff=16, norm_first=False, ffn="relu")
    block = transformer_block(cfg).eval()
    x = torch.randn(1, 4, 8)
    assert not torch.allclose(block(x, score_mod=qkv.softcap(0.5)), block(x))
