"""``MultiHeadAttention(forget_gate=True)`` and ``model.block.forget_gate``: the layer equals a
float64 reference written here from the Forgetting Transformer's formula (outputs and every
gradient, the gate's included), and decoding with the KV cache, which keeps the gate's
cumulative sums, equals the whole forward in GPT and the encoder-decoder Transformer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.cli import main
from qkv.models import GPT, GPTConfig, Transformer
from qkv.models.configs import TransformerConfig
from qkv.nn import MultiHeadAttention

from ..train.conftest import tiny_lm


def formula(m: MultiHeadAttention, x):
    """Forgetting attention in float64, with explicit decays: s_ij = q_i·k_j/√D +
    Σ_{l=j+1..i} log σ(w_h·x_l + b_h) for j <= i, softmax over j, then W^O."""
    b, n, _ = x.shape
    h, hkv, d = m.n_head, m.n_kv_head, m.head_dim
    q = m.q_proj(x).view(b, n, h, d).transpose(1, 2)
    k = m.k_proj(x).view(b, n, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    v = m.v_proj(x).view(b, n, hkv, d).transpose(1, 2).repeat_interleave(h // hkv, 1)
    log_f = F.logsigmoid(m.forget_proj(x)).transpose(1, 2)           # (B, H, N)
    rows = []
    for i in range(n):
        decay = torch.stack([log_f[:, :, j + 1:i + 1].sum(-1) for j in range(i + 1)], -1)
        s = q[:, :, i:i + 1] @ k[:, :, :i + 1].transpose(-1, -2) / d ** 0.5
        rows.append(torch.softmax(s + decay.unsqueeze(2), -1) @ v[:, :, :i + 1])
    return m.out_proj(torch.cat(rows, 2).transpose(1, 2).reshape(b, n, h * d))


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_the_gated_layer_equals_the_formula(backend):
    torch.manual_seed(0)
    m = MultiHeadAttention(32, 4, n_kv_head=2, forget_gate=True).double()
    with torch.no_grad():
        m.forget_proj.bias.fill_(2.0)  # forget values near σ(2), as trained gates are
    if backend == "fused":
        def attend(q, k, v, **kwargs):
            return qkv.attention(q, k, v, backend="fused", **kwargs), None
        m.attend = attend
    x = torch.randn(2, 17, 32, dtype=torch.float64, requires_grad=True)
    want, got = formula(m, x), m(x, mask=qkv.causal())
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    inputs = (x, *m.parameters())
    grads_want = torch.autograd.grad(want.square().sum(), inputs)
    grads = torch.autograd.grad(got.square().sum(), inputs)
    assert m.forget_proj.weight is inputs[-2] and grads[-2].abs().max() > 0
    for g, g_want in zip(grads, grads_want, strict=True):
        torch.testing.assert_close(g, g_want, rtol=1e-10, atol=1e-11)


def _gpt(positions: str, n_layer: int = 2) -> GPT:
    torch.manual_seed(1)
    block = {"d_model": 16, "n_head": 4, "n_kv_head": 2, "forget_gate": True}
    return GPT(GPTConfig(vocab_size=30, block_size=24, n_layer=n_layer, block=block,
                         positions={"kind": positions})).double().eval()


@pytest.mark.parametrize("positions", ["none", "alibi", "rope"])
def test_gpt_decodes_with_its_cache_as_its_whole_forward(positions):
    model = _gpt(positions)
    assert all(block.self_attn.forget_proj is not None for block in model.blocks)
    idx = torch.randint(0, 30, (2, 12))
    with torch.no_grad():
        whole = model(idx)
        cache = model.new_cache(2, 24)
        steps = [model(idx[:, :5], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-10, atol=1e-10)


def test_padded_batches_and_beams_generate_as_without_the_cache():
    model = _gpt("none")
    prompts = torch.tensor([[3, 4, 5, 6], [7, 8, 0, 0]])
    lengths = torch.tensor([4, 2])
    batch = model.generate(prompts, 5, temperature=0, lengths=lengths)
    for row in range(2):
        alone = model.generate(prompts[row:row + 1, :lengths[row]], 5, temperature=0)
        assert torch.equal(batch[row, :lengths[row] + 5], alone[0])
    beams = model.generate(prompts[:1], 4, beam_size=3)
    assert torch.equal(beams, model.generate(prompts[:1], 4, beam_size=3, use_cache=False))


def test_the_transformer_gates_its_self_attention_only():
    torch.manual_seed(2)
    model = Transformer(TransformerConfig(
        src_vocab_size=20, tgt_vocab_size=20, max_len=16, n_encoder_layers=1,
        n_decoder_layers=1, block={"d_model": 16, "n_head": 2, "forget_gate": True})).double()
    layer = model.decoder[0]
    assert layer.self_attn.forget_proj is not None and layer.cross_attn.forget_proj is None
    src = torch.randint(3, 20, (2, 7))
    model.eval()
    assert torch.equal(model.generate(src, max_new_tokens=6),
                       model.generate(src, max_new_tokens=6, use_cache=False))


def test_qkv_train_takes_the_forget_gate_from_the_command_line(tmp_path):
    assert main(tiny_lm(tmp_path / "run", 2, "--set", "model.block.forget_gate=true")) == 0


def test_kinds_without_softmax_scores_refuse_the_gate():
    for kind in ("linear", "retention"):
        with pytest.raises(ValueError, match=f"attention='{kind}' cannot take it"):
            GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1,
                          block={"d_model": 8, "n_head": 2, "attention": kind,
                                 "forget_gate": True}))
    with pytest.raises(ValueError, match="forget_gate applies to self-attention only"):
        MultiHeadAttention(8, 2, is_cross=True, forget_gate=True)
