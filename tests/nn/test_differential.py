"""Differential attention equals a float64 reference written here from the paper's formula
(outputs, difference maps and every gradient), on the dispatcher's engine and the fused CPU
engine; decoding with its KV cache equals the whole forward; a block and every model family
build it from the config string ``attention="differential"``."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv.cli import main
from qkv.models import GPT, Encoder, GPTConfig, Transformer, ViT
from qkv.models.configs import EncoderConfig, TransformerConfig, ViTConfig
from qkv.nn import BlockConfig, DifferentialAttention, RotaryEmbedding, transformer_block
from qkv.nn.differential import every_other_frequency, lambda_init

from ..train.conftest import tiny_lm


def formula(m: DifferentialAttention, x, allowed, *, rope=False, bias=None):
    """The paper's differential attention in float64 (microsoft/unilm's layout): returns the
    output (B, N, d_model) and the difference maps (B, H, N, N). ``allowed`` (N, N) bool;
    ``bias`` (H, N, N) added to both maps' scores of head h; ``rope``: q and k rotated at
    positions 0..N-1 by RoPE of head_dim itself (the layer is given the stack's rotation of
    2·head_dim; tests/nn/test_positions.py checks RoPE against its formula)."""
    b, n, _ = x.shape
    h, hkv, d = m.n_head, m.n_kv_head, m.head_dim
    q = m.q_proj(x).view(b, n, 2 * h, d).transpose(1, 2)
    k = m.k_proj(x).view(b, n, 2 * hkv, d).transpose(1, 2)
    v = m.v_proj(x).view(b, n, hkv, 2 * d).transpose(1, 2)
    if rope:
        rotation = RotaryEmbedding(d).double().rotation(torch.arange(n))
        q, k = RotaryEmbedding(d)(q, rotation), RotaryEmbedding(d)(k, rotation)
    k = k.repeat_interleave(h // hkv, dim=1)                       # unilm's repeat_kv
    v = v.repeat_interleave(h // hkv, dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    if bias is not None:
        s = s + bias.repeat_interleave(2, dim=0)
    a = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1).view(b, h, 2, n, n)
    lam = (torch.exp((m.lambda_q1 * m.lambda_k1).sum()) - torch.exp((m.lambda_q2 * m.lambda_k2)
           .sum()) + 0.8 - 0.6 * math.exp(-0.3 * m.depth))
    diff = a[:, :, 0] - lam * a[:, :, 1]
    o = diff @ v
    o = o / torch.sqrt(o.square().mean(-1, keepdim=True) + 1e-5) * m.subln.weight
    o = o * (1 - (0.8 - 0.6 * math.exp(-0.3 * m.depth)))
    return m.out_proj(o.transpose(1, 2).reshape(b, n, 2 * h * d)), diff


def on_fused(module):
    """The layer's attention forced onto the fused CPU engine (its one call point)."""
    def attend(q, k, v, **kwargs):
        result = qkv.attention(q, k, v, backend="fused", **kwargs)
        return result if kwargs["return_weights"] else (result, None)
    module.attend = attend
    return module


def _grads(out, module, x):
    return torch.autograd.grad(out.square().sum(), (x, *module.parameters()))


@pytest.mark.parametrize("engine", ["auto", "fused"])
@pytest.mark.parametrize(("n_kv_head", "rope", "depth"), [(None, False, 0), (2, True, 3),
                                                           (1, True, 1)])
def test_differential_attention_equals_the_formula(engine, n_kv_head, rope, depth):
    torch.manual_seed(0)
    # The stack's rotation is for d_model / n_head = 2 * head_dim: the layer takes every
    # other frequency, which is head_dim's rotation with the same base.
    m = DifferentialAttention(64, 4, depth=depth, n_kv_head=n_kv_head, bias=True,
                              rope=RotaryEmbedding(16) if rope else None).double()
    if engine == "fused":
        on_fused(m)
    with torch.no_grad():
        m.subln.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 19, 64, dtype=torch.float64, requires_grad=True)
    allowed = torch.ones(19, 19, dtype=torch.bool).tril()
    want, diff_want = formula(m, x, allowed, rope=rope)
    with torch.no_grad():
        got, diff = m(x, mask=qkv.causal(), return_weights=True)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.allclose(diff, diff_want, rtol=0, atol=1e-12)
    got = m(x, mask=qkv.causal())
    for g, g_want in zip(_grads(got, m, x), _grads(want, m, x), strict=True):
        assert torch.allclose(g, g_want, rtol=1e-10, atol=1e-11)


def test_the_stacks_rotation_gives_head_dims_by_every_other_frequency():
    positions = torch.arange(40)
    half = every_other_frequency(RotaryEmbedding(16, 500.0).rotation(positions))
    want = RotaryEmbedding(8, 500.0).rotation(positions)
    assert torch.equal(half.cos, want.cos) and torch.equal(half.sin, want.sin)


def test_a_modifier_for_n_head_heads_applies_to_both_maps_of_each_head():
    torch.manual_seed(1)
    m = on_fused(DifferentialAttention(32, 4, depth=2).double())
    x = torch.randn(1, 11, 32, dtype=torch.float64, requires_grad=True)
    slopes = qkv.core.scores.alibi_slopes(4).double()
    distance = (torch.arange(11)[:, None] - torch.arange(11)).abs().double()
    want, _ = formula(m, x, torch.ones(11, 11, dtype=torch.bool).tril(),
                      bias=-slopes[:, None, None] * distance)
    got = m(x, mask=qkv.causal(), score_mod=qkv.alibi(slopes=slopes))
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    for g, g_want in zip(_grads(got, m, x), _grads(want, m, x), strict=True):
        assert torch.allclose(g, g_want, rtol=1e-10, atol=1e-11)


def test_decoding_with_the_cache_equals_the_whole_forward():
    torch.manual_seed(2)
    m = DifferentialAttention(32, 2, depth=1, n_kv_head=1, rope=RotaryEmbedding(8)).double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    with torch.no_grad():
        whole = m(x, mask=qkv.causal())
        cache = m.new_cache(2, 16)
        steps = [m(x[:, :5], mask=qkv.causal(), cache=cache)]
        steps += [m(x[:, t:t + 1], mask=qkv.causal(), cache=cache) for t in range(5, 12)]
    assert cache.length == 12
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-12, atol=1e-12)


def test_a_block_from_its_config_is_the_formula_inside_residuals():
    torch.manual_seed(3)
    cfg = BlockConfig(d_model=32, n_head=2, d_ff=64, attention="differential", bias=False)
    block = transformer_block(cfg, RotaryEmbedding(cfg.head_dim), depth=4).double()
    attn = block.self_attn
    assert isinstance(attn, DifferentialAttention) and attn.depth == 4
    assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-1.2))
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    h = x + formula(attn, block.attn_sublayer.norm(x), torch.ones(9, 9).tril().bool(),
                    rope=True)[0]
    want = h + block.ffn(block.ffn_sublayer.norm(h))
    # the stack's rotation of 2·head_dim, as a model hands it to its layers
    got = block(x, mask=qkv.causal(), positions=attn.rope.rotation(torch.arange(9)))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(block(x, mask=qkv.causal()), want, rtol=1e-12, atol=1e-12)


def test_gpt_builds_differential_layers_by_depth_and_decodes_with_its_cache():
    torch.manual_seed(4)
    model = GPT(GPTConfig(vocab_size=30, block_size=24, n_layer=3,
                          block={"d_model": 32, "n_head": 2, "attention": "differential"},
                          positions={"kind": "rope"})).double().eval()
    layers = [block.self_attn for block in model.blocks]
    assert all(isinstance(layer, DifferentialAttention) for layer in layers)
    assert [layer.lambda_init for layer in layers] == [lambda_init(i) for i in range(3)]
    idx = torch.randint(0, 30, (2, 12))
    with torch.no_grad():
        whole = model(idx)
        cache = model.new_cache(2, 24)
        steps = [model(idx[:, :5], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-10, atol=1e-10)
    prompt = torch.tensor([[1, 2, 3]])
    assert torch.equal(model.generate(prompt, 5, temperature=0),
                       model.generate(prompt, 5, temperature=0, use_cache=False))


def test_every_model_family_takes_differential_attention():
    torch.manual_seed(5)
    block = {"d_model": 32, "n_head": 2, "attention": "differential"}
    encoder = Encoder(EncoderConfig(vocab_size=20, num_classes=0, max_len=10, n_layer=2,
                                    block=block, positions={"kind": "alibi"}))
    assert encoder(torch.randint(1, 20, (2, 10))).shape == (2, 10, 32)
    vit = ViT(ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, n_layer=1,
                        block=block))
    assert vit(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    translate = Transformer(TransformerConfig(
        src_vocab_size=20, tgt_vocab_size=20, max_len=16, n_encoder_layers=1, n_decoder_layers=2,
        block=block, positions={"kind": "rope"})).double().eval()
    assert translate.decoder[1].cross_attn.is_cross and translate.decoder[1].self_attn.depth == 1
    src = torch.randint(3, 20, (2, 7))
    assert torch.equal(translate.generate(src, max_new_tokens=6),
                       translate.generate(src, max_new_tokens=6, use_cache=False))


def test_qkv_train_takes_differential_attention_from_the_command_line(tmp_path):
    assert main(tiny_lm(tmp_path / "run", 2, "--set", "model.block.attention=differential")) == 0


@pytest.mark.parametrize(("block", "message"), [
    ({"similarity": "cosine"}, "similarity must be 'dot'"),
    ({"weighting": "sigmoid"}, "weighting must be 'softmax'"),
    ({"forget_gate": True}, "attention='differential' cannot take it"),
    ({"d_model": 12, "n_head": 4}, r"divisible by 2 \* n_head=8"),
])
def test_differential_refuses_what_it_cannot_compute(block, message):
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1,
                      block={"d_model": 16, "n_head": 2, "attention": "differential", **block}))


def test_differential_attention_refuses_bad_arguments():
    with pytest.raises(ValueError, match="depth must be the layer's 0-based index"):
        DifferentialAttention(32, 2, depth=-1)
    with pytest.raises(ValueError, match="rope must rotate head_dim=8 or 2 \\* head_dim=16"):
        DifferentialAttention(32, 2, depth=0, rope=RotaryEmbedding(4))
    with pytest.raises(ValueError, match=r"x must have shape \(B, N, 32\)"):
        DifferentialAttention(32, 2, depth=0)(torch.randn(1, 3, 16))
