"""MultiHeadAttention: parity with torch.nn.MultiheadAttention, grouped heads, the KV cache."""

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.nn import MultiHeadAttention

ATOL = 1e-5


def torch_mha(batch_first, bias=True, kdim=None, vdim=None, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(12, 3, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    if bias:  # torch initializes the biases to zero; make them count
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m.eval()


def run_torch(m, q, k, v, **kwargs):
    """torch's module on (B, N, E) inputs, whatever its batch_first."""
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    out, weights = m(q, k, v, **kwargs)
    return (out if m.batch_first else out.transpose(0, 1)), weights


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_from_torch_matches_plain_and_key_padding(batch_first, bias):
    m = torch_mha(batch_first, bias)
    ours = MultiHeadAttention.from_torch(m).eval()
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 5, 12, generator=g), torch.randn(2, 7, 12, generator=g)
    lengths = torch.tensor([7, 4])
    key_padding = torch.arange(7)[None] >= lengths[:, None]
    with torch.no_grad():
        ref, ref_w = run_torch(m, q, k, k, key_padding_mask=key_padding)
        out, w = ours(q, k, mask=qkv.padding(lengths), return_weights=True)
    assert (out - ref).abs().max() < ATOL
    assert (w.mean(1) - ref_w).abs().max() < ATOL


def test_from_torch_attn_mask_causal_and_per_head_weights():
    m = torch_mha(True)
    ours = MultiHeadAttention.from_torch(m).eval()
    x = torch.randn(2, 6, 12, generator=torch.Generator().manual_seed(2))
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)  # torch: True = masked out
    with torch.no_grad():
        ref, ref_w = m(x, x, x, attn_mask=causal, average_attn_weights=False)
        out, w = ours(x, mask=qkv.causal(), return_weights=True)
        ref_c, _ = m(x, x, x, attn_mask=causal, is_causal=True, need_weights=False)
        out_c = ours(x, mask=qkv.causal())
        banned = torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.6
        banned[:, 0] = False  # every row keeps a key, as torch needs to avoid NaN
        ref_m, ref_mw = m(x, x, x, attn_mask=banned)
        out_m, w_m = ours(x, mask=~banned, return_weights=True)
    assert ref_w.shape == w.shape == (2, 3, 6, 6)
    for a, b in ((out, ref), (w, ref_w), (out_c, ref_c), (out_m, ref_m), (w_m.mean(1), ref_mw)):
        assert (a - b).abs().max() < ATOL


def test_from_torch_separate_kdim_vdim():
    m = torch_mha(False, kdim=5, vdim=7)
    ours = MultiHeadAttention.from_torch(m).eval()
    g = torch.Generator().manual_seed(4)
    q, k, v = torch.randn(2, 3, 12, generator=g), torch.randn(2, 4, 5, generator=g), torch.randn(
        2, 4, 7, generator=g
    )
    with torch.no_grad():
        ref, _ = run_torch(m, q, k, v, need_weights=False)
        out = ours(q, k, v)
    assert (out - ref).abs().max() < ATOL


def test_from_torch_refuses_bias_kv():
    m = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(m)
    with pytest.raises(TypeError, match="MultiheadAttention"):
        MultiHeadAttention.from_torch(torch.nn.Linear(2, 2))


def test_grouped_heads_equal_repeated_full_heads():
    torch.manual_seed(0)
    gqa = MultiHeadAttention(16, 4, n_kv_head=2).eval()
    full = MultiHeadAttention(16, 4).eval()
    d = 4
    with torch.no_grad():
        full.q_proj.load_state_dict(gqa.q_proj.state_dict())
        full.out_proj.load_state_dict(gqa.out_proj.state_dict())
        for src, dst in ((gqa.k_proj, full.k_proj), (gqa.v_proj, full.v_proj)):
            # kv head j serves query heads 2j and 2j + 1
            dst.weight.copy_(src.weight.view(2, d, 16).repeat_interleave(2, 0).reshape(16, 16))
            dst.bias.copy_(src.bias.view(2, d).repeat_interleave(2, 0).reshape(16))
    x = torch.randn(2, 5, 16)
    assert torch.allclose(gqa(x, mask=qkv.causal()), full(x, mask=qkv.causal()), atol=1e-6)


@pytest.mark.parametrize("use_rope", [False, True])
def test_kv_cache_matches_full_causal(use_rope):
    torch.manual_seed(0)
    rope = qkv.nn.RotaryEmbedding(4) if use_rope else None
    m = MultiHeadAttention(16, 4, n_kv_head=2, rope=rope).eval()
    x = torch.randn(2, 9, 16)
    full = m(x, mask=qkv.causal())
    cache = m.new_cache(2, 9)
    chunks = [m(x[:, :4], mask=qkv.causal(), cache=cache)]
    chunks += [m(x[:, i:i + 1], mask=qkv.causal(), cache=cache) for i in range(4, 7)]
    chunks.append(m(x[:, 7:], mask=qkv.causal(), cache=cache))
    assert torch.allclose(torch.cat(chunks, 1), full, atol=1e-6)
    assert cache.length == 9
    with pytest.raises(ValueError, match="max_len=9"):
        m(x[:, :1], mask=qkv.causal(), cache=cache)


def test_rope_self_attention_with_a_longer_key_answers_the_last_queries():
    """key (B, Nk) with query (B, Nq), Nq < Nk: the queries are the last Nq positions, rotated
    there, so the outputs are the last rows of the full call."""
    torch.manual_seed(0)
    m = MultiHeadAttention(16, 4, n_kv_head=2, rope=qkv.nn.RotaryEmbedding(4)).eval()
    x = torch.randn(2, 9, 16)
    full = m(x, mask=qkv.causal())
    torch.testing.assert_close(m(x[:, -3:], x, mask=qkv.causal()), full[:, -3:])
    with pytest.raises(ValueError, match="last Nq of its keys: query has 9 positions, key 3"):
        m(x, x[:, :3], mask=qkv.causal())


def test_cross_attention_cache_keeps_memory():
    torch.manual_seed(0)
    m = MultiHeadAttention(8, 2, is_cross=True).eval()
    x, memory = torch.randn(1, 3, 8), torch.randn(1, 5, 8)
    cache = m.new_cache(1, 5)
    first = m(x[:, :1], memory, cache=cache)
    later = m(x[:, 1:], cache=cache)
    assert torch.allclose(torch.cat((first, later), 1), m(x, memory), atol=1e-6)
    assert m.is_cross
    with pytest.raises(ValueError, match="key"):
        m(x)


def test_returned_weights_and_similarities():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    for similarity in ("cosine", "l1", "l2", "mahalanobis"):
        m = MultiHeadAttention(8, 2, similarity=similarity)
        out, weights = m(x, return_weights=True)
        assert out.shape == (2, 4, 8)
        assert torch.allclose(weights.sum(-1), torch.ones(2, 2, 4))
    assert m.metric.shape == (2, 4, 4)
    with torch.no_grad():
        m.metric.add_(0.1 * torch.randn(2, 4, 4))  # a metric other than the identity
    m(x).sum().backward()
    # The metric's gradient against the same attention in float64, written out:
    # score = -||L(q - k)||^2 / sqrt(d) per head.
    metric = m.metric.detach().double().requires_grad_()
    q, k, v = (F.linear(x.double(), p.weight.double(), p.bias.double())
               .view(2, 4, 2, 4).transpose(1, 2) for p in (m.q_proj, m.k_proj, m.v_proj))
    diff = q[:, :, :, None, :] - k[:, :, None, :, :]  # (B, H, Nq, Nk, d)
    scores = -(diff @ metric.transpose(-1, -2)[None, :, None]).square().sum(-1) / 2
    out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 4, 8)
    F.linear(out, m.out_proj.weight.double(), m.out_proj.bias.double()).sum().backward()
    torch.testing.assert_close(m.metric.grad, metric.grad.float(), rtol=1e-4, atol=1e-5)


def test_a_learnable_per_head_temperature_trains_with_the_module():
    """Swin V2's cosine attention: scale an nn.Parameter of shape (H,), registered with the
    module, its gradient that of the same attention called directly."""
    torch.manual_seed(0)
    temperature = torch.nn.Parameter(torch.tensor([4.0, 10.0]))
    m = MultiHeadAttention(8, 2, similarity="cosine", scale=temperature)
    assert any(p is temperature for p in m.parameters())
    x = torch.randn(2, 5, 8)
    m(x).square().sum().backward()
    grad = temperature.grad.clone()
    temperature.grad = None
    q, k, v = (proj(x).view(2, 5, 2, 4).transpose(1, 2) for proj in (m.q_proj, m.k_proj, m.v_proj))
    out = qkv.attention(q, k, v, similarity="cosine", scale=temperature, backend="reference")
    m.out_proj(out.transpose(1, 2).reshape(2, 5, 8)).square().sum().backward()
    torch.testing.assert_close(grad, temperature.grad)


def test_bad_heads():
    with pytest.raises(ValueError, match="divisible by n_head"):
        MultiHeadAttention(10, 3)
    with pytest.raises(ValueError, match="divisible by n_kv_head"):
        MultiHeadAttention(12, 4, n_kv_head=3)
