"""LinearAttention and Retention as attention kinds: module behaviour, incremental state, and
GPT models that train and generate with them (cached == uncached)."""

import pytest
import torch

import qkv
from qkv.core.linear import linear_attention
from qkv.models import GPT, Encoder, EncoderConfig, GPTConfig, Transformer, TransformerConfig
from qkv.nn.kinds import ATTENTION_KINDS, build_attention
from qkv.nn.linear_attention import LinearAttention
from qkv.nn.retention import Retention

KINDS = ["linear", "linear_favor", "retention"]


def kind_module(kind, d_model=16, n_head=4, n_kv_head=2, is_cross=False):
    torch.manual_seed(0)
    return build_attention(
        kind, d_model=d_model, n_head=n_head, n_kv_head=n_kv_head, bias=True, dropout=0.0,
        similarity="dot", weighting="softmax", rope=None, is_cross=is_cross,
    ).double().eval()


def inputs(b=2, n=11, d=16, seed=0):
    return torch.randn(b, n, d, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def test_kinds_are_registered():
    assert {"linear", "linear_favor", "retention"} <= set(ATTENTION_KINDS)
    m = kind_module("retention")
    assert isinstance(m, Retention) and m.is_cross is False


def test_linear_module_is_projections_around_the_core():
    m = kind_module("linear")
    x = inputs()
    q = m.q_proj(x).view(2, 11, 4, 4).transpose(1, 2)
    k = m.k_proj(x).view(2, 11, 2, 4).transpose(1, 2)
    v = m.v_proj(x).view(2, 11, 2, 4).transpose(1, 2)
    core = linear_attention(q, k, v, causal=True, chunk_size=m.chunk_size)
    expected = m.out_proj(core.transpose(1, 2).flatten(2))
    assert torch.allclose(m(x, mask=qkv.causal()), expected, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_causal_output_ignores_the_future(kind):
    m = kind_module(kind)
    x = inputs()
    y = x.clone()
    y[:, 7:] += 1.0
    assert torch.allclose(m(x, mask=qkv.causal())[:, :7], m(y, mask=qkv.causal())[:, :7],
                          atol=1e-12)
    assert not torch.allclose(m(x)[:, :7], m(y)[:, :7])  # no mask: bidirectional


@pytest.mark.parametrize("kind", KINDS)
def test_incremental_state_matches_whole_sequence(kind):
    m = kind_module(kind)
    x = inputs()
    whole = m(x, mask=qkv.causal())
    cache = m.new_cache(2, 11)
    parts = [m(x[:, :5], mask=qkv.causal(), cache=cache)]
    for i in range(5, 11):
        parts.append(m(x[:, i:i + 1], mask=qkv.causal(), cache=cache))
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-10)
    assert cache.length == 11


@pytest.mark.parametrize("kind", KINDS)
def test_left_padding_is_invisible(kind):
    """Rows padded on the left by p tokens give, on their real tokens, the output of the
    unpadded row (the GPT's batched-prompt path)."""
    m = kind_module(kind)
    x = inputs(b=1, n=8)
    padded = torch.cat([inputs(b=1, n=3, seed=5), x], 1)
    mask = qkv.causal() & ~qkv.padding(torch.tensor([3]))
    assert torch.allclose(m(padded, mask=mask)[:, 3:], m(x, mask=qkv.causal()), atol=1e-10)


def test_reorder_state_for_beam_search():
    m = kind_module("retention")
    x = inputs()
    cache = m.new_cache(2, 11)
    m(x[:, :6], mask=qkv.causal(), cache=cache)
    cache.reorder(torch.tensor([1, 1]))
    out = m(x[1:, 6:7].expand(2, 1, 16), mask=qkv.causal(), cache=cache)
    whole = m(x[1:], mask=qkv.causal())
    assert torch.allclose(out, whole[:, 6:7].expand(2, 1, 16), atol=1e-10)


def test_linear_cross_attention_keeps_the_memory_summary():
    m = kind_module("linear", is_cross=True)
    x, memory = inputs(n=4), inputs(n=9, seed=1)
    lengths = qkv.padding(torch.tensor([9, 5]))
    full = m(x, memory, mask=lengths)
    cache = m.new_cache(2, 9)
    first = m(x[:, :2], memory, mask=lengths, cache=cache)
    rest = m(x[:, 2:], None, mask=lengths, cache=cache)
    assert torch.allclose(torch.cat([first, rest], 1), full, atol=1e-12)
    short = m(x[1:], memory[1:, :5])
    assert torch.allclose(full[1:], short, atol=1e-12)


def test_favor_redraws_in_training_only():
    m = LinearAttention(16, 4, feature_map="favor", redraw_interval=2)
    before = m.projection.clone()
    m.eval()
    for _ in range(3):
        m(inputs().float())
    assert torch.equal(m.projection, before)
    m.train()
    m(inputs().float())
    assert torch.equal(m.projection, before)
    m(inputs().float())
    assert not torch.equal(m.projection, before)
    assert "projection" in m.state_dict()


def test_weights_score_mods_and_masks_refused():
    lin, ret = kind_module("linear"), kind_module("retention")
    x = inputs()
    with pytest.raises(ValueError, match="no attention weights"):
        lin(x, return_weights=True)
    with pytest.raises(ValueError, match="no attention weights.*decay matrix"):
        ret(x, return_weights=True)
    with pytest.raises(ValueError, match="cannot apply a score_mod"):
        ret(x, score_mod=qkv.softcap(5.0))
    with pytest.raises(ValueError, match="only qkv.causal.. and key padding masks"):
        lin(x, mask=qkv.sliding_window(3))
    with pytest.raises(ValueError, match="no cross-attention form"):
        kind_module("retention", is_cross=True)
    with pytest.raises(ValueError, match="chunk_size must be a positive int; got 0"):
        Retention(16, 4, chunk_size=0)
    with pytest.raises(ValueError, match="chunk_size must be a positive int; got -1"):
        LinearAttention(16, 4, chunk_size=-1)
    with pytest.raises(ValueError, match="num_features must be a positive int; got 0"):
        LinearAttention(16, 4, feature_map="favor", num_features=0)
    with pytest.raises(ValueError, match="similarity must be 'dot'"):
        build_attention("linear", d_model=16, n_head=4, n_kv_head=None, bias=True, dropout=0.0,
                        similarity="l2", rope=None, is_cross=False)


def tiny_gpt(kind, positions="learned", dtype=torch.float64):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=23, block_size=32, n_layer=2,
                       block={"n_head": 4, "d_model": 16, "n_kv_head": 2, "attention": kind},
                       positions={"kind": positions})
    return GPT(config).to(dtype)


@pytest.mark.parametrize("kind", KINDS)
def test_gpt_trains(kind):
    model = tiny_gpt(kind, dtype=torch.float32)
    ids = torch.randint(0, 23, (4, 16), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]
    attn = model.blocks[0].self_attn
    assert attn.q_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_gpt_generation_cached_equals_uncached(kind, positions):
    model = tiny_gpt(kind, positions).eval()
    prompt = torch.randint(0, 23, (3, 6), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([6, 4, 2])
    kw = {"max_new_tokens": 8, "lengths": lengths}
    sampled = [
        model.generate(prompt, use_cache=c, temperature=1.0,
                       generator=torch.Generator().manual_seed(2), **kw)
        for c in (True, False)
    ]
    assert torch.equal(sampled[0], sampled[1])
    beams = {c: model.generate(prompt, beam_size=2, use_cache=c, **kw) for c in (True, False)}
    assert torch.equal(beams[True], beams[False])


def test_gpt_with_alibi_refused_clearly():
    model = tiny_gpt("retention", positions="alibi")
    with pytest.raises(ValueError, match="cannot apply a score_mod"):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_trains_and_ignores_padding(kind):
    torch.manual_seed(0)
    config = EncoderConfig(vocab_size=20, num_classes=3, max_len=16, n_layer=2,
                           block={"n_head": 4, "d_model": 16, "dropout": 0.0, "attention": kind})
    model = Encoder(config).double()
    ids = torch.randint(1, 20, (2, 9), generator=torch.Generator().manual_seed(2))
    ids[1, 6:] = 0
    logits = model(ids)
    assert torch.allclose(logits[1], model(ids[1:, :6])[0], atol=1e-10)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2]))
    loss.backward()
    assert model.blocks[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_transformer_with_linear_attention_generates_cached_equals_uncached():
    torch.manual_seed(0)
    block = {"d_model": 16, "n_head": 4, "d_ff": 32, "dropout": 0.0, "attention": "linear"}
    config = TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, block=block,
                               n_encoder_layers=1, n_decoder_layers=2, max_len=32)
    model = Transformer(config).double()
    src = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(3))
    lengths = torch.tensor([7, 4])
    kw = {"src_lengths": lengths, "max_new_tokens": 6}
    sampled = [
        model.generate(src, use_cache=c, temperature=1.0,
                       generator=torch.Generator().manual_seed(4), **kw)
        for c in (True, False)
    ]
    assert torch.equal(sampled[0], sampled[1])
    beams = [model.generate(src, beam_size=2, use_cache=c, **kw) for c in (True, False)]
    assert torch.equal(beams[0], beams[1])
