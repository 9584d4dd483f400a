"""Capture: the recomputed maps equal the reference weights, outputs stay bit-identical, only
the chosen heads are kept, and bad requests say what is valid."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.core.problem import build_problem
from qkv.core.reference import reference_attention
from qkv.models import (
    GPT,
    Encoder,
    EncoderConfig,
    GPTConfig,
    Transformer,
    TransformerConfig,
    ViT,
    ViTConfig,
)
from qkv.viz import attention_rollout, capture, head_weights

torch.manual_seed(0)


def _reference(q, k, **kw):
    _, weights = qkv.attention(q, k, k, return_weights=True, backend="reference", **kw)
    return weights


CASES = {
    "dot-causal-gqa": dict(similarity="dot", mask=qkv.causal(), kv_heads=2),
    "cosine-alibi": dict(similarity="cosine", score_mod=qkv.alibi(4)),
    "l2-window": dict(similarity="l2", mask=qkv.sliding_window(2)),
    "l1-softcap": dict(similarity="l1", score_mod=qkv.softcap(3.0)),
    "mahalanobis-per-head": dict(similarity="mahalanobis", metric=True),
    "per-head-scale-and-mask": dict(similarity="dot", scale=True, head_mask=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_head_weights_equal_reference_for_chosen_heads(case):
    cfg = dict(CASES[case])
    heads, kv_heads = 4, cfg.pop("kv_heads", 4)
    q = torch.randn(2, heads, 5, 8, dtype=torch.float64)
    k = torch.randn(2, kv_heads, 7, 8, dtype=torch.float64)
    if cfg.pop("metric", False):
        cfg["metric"] = torch.randn(heads, 8, 8, dtype=torch.float64)
    if cfg.pop("scale", False):
        cfg["scale"] = torch.tensor([0.1, 0.5, 1.0, 2.0], dtype=torch.float64)
    if cfg.pop("head_mask", False):
        cfg["mask"] = torch.rand(1, heads, 5, 7) > 0.3
    chosen = [3, 1]
    got = head_weights(q, k, chosen, **cfg)
    want = _reference(q, k, **cfg)[:, [1, 3]]
    assert got.shape == (2, 2, 5, 7)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@settings(max_examples=25, deadline=None)
@given(
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1), (2, 2)]),
    nq=st.integers(1, 5), nk=st.integers(1, 6), data=st.data(),
)
def test_any_head_subset_matches_reference(heads, nq, nk, data):
    h, hkv = heads
    chosen = data.draw(st.lists(st.integers(0, h - 1), min_size=1, max_size=h, unique=True))
    causal = data.draw(st.booleans())
    q, k = torch.randn(1, h, nq, 4, dtype=torch.float64), torch.randn(1, hkv, nk, 4,
                                                                        dtype=torch.float64)
    mask = qkv.causal() if causal else None
    got = head_weights(q, k, chosen, mask=mask, score_mod=qkv.alibi(h))
    want = _reference(q, k, mask=mask, score_mod=qkv.alibi(h))[:, sorted(chosen)]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_head_weights_from_saved_log_sum_exp():
    q = torch.randn(1, 3, 6, 4, dtype=torch.float64)
    k = torch.randn(1, 3, 6, 4, dtype=torch.float64)
    mask = qkv.causal() & qkv.sliding_window(2)
    problem = build_problem(q, k, k, mask=mask, score_mod=None, similarity="dot", scale=None,
                            metric=None, dropout_p=0.0, return_weights=True)
    _, weights, lse = reference_attention(problem)
    got = head_weights(q, k, [2], mask=mask, lse=lse)
    torch.testing.assert_close(got, weights[:, [2]], rtol=1e-12, atol=1e-12)
    got = head_weights(q, k, [0, 1], mask=mask, lse=lse.unsqueeze(-1))  # the fused layout
    torch.testing.assert_close(got, weights[:, [0, 1]], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="lse must be"):
        head_weights(q, k, [0], lse=lse[:, :2])


def test_head_weights_from_the_fused_engines_log_sum_exp():
    """The fused CPU engine's forward keeps only out and lse; the chosen heads' weights rebuilt
    from that lse equal the reference's."""
    q, k, v = torch.randn(1, 4, 40, 8), torch.randn(1, 2, 40, 8), torch.randn(1, 2, 40, 8)
    kw = dict(mask=qkv.causal(), score_mod=qkv.alibi(4), similarity="l2")
    _, lse = qkv.attention(q, k, v, return_lse=True, backend="fused", **kw)
    got = head_weights(q, k, [1, 3], lse=lse, **kw)
    _, want = qkv.attention(q, k, v, return_weights=True, backend="reference", **kw)
    torch.testing.assert_close(got, want[:, [1, 3]], rtol=1e-5, atol=1e-6)


def _gpt(positions="learned", block=None, **kw):
    cfg = dict(vocab_size=20, block_size=16, n_layer=2,
               block={"n_head": 4, "d_model": 32, **(block or {})}, positions={"kind": positions})
    cfg.update(kw)
    return GPT(GPTConfig(**cfg)).eval()


@pytest.mark.parametrize("positions", ["alibi", "rope"])
def test_capture_matches_the_layers_own_weights_and_leaves_outputs_unchanged(positions):
    model = _gpt(positions=positions, block={"n_kv_head": 2}).double()
    idx = torch.randint(0, 20, (2, 9))
    plain = model(idx)
    with capture(model, layers=[1], heads=[0, 3]) as maps:
        captured = model(idx)
    assert torch.equal(plain, captured)
    layer = model.blocks[1].self_attn
    assert "attend" not in layer.__dict__  # the class's own attend again
    # The slow path that computes every head's weights, for comparison only: the layer's call
    # in the forward pass, repeated with return_weights.
    seen = {}
    hook = layer.register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(args=args, kwargs=kwargs), with_kwargs=True)
    model(idx)
    hook.remove()
    _, weights = layer(*seen["args"], **seen["kwargs"], return_weights=True)
    torch.testing.assert_close(maps[1], weights[:, [0, 3]], rtol=1e-10, atol=1e-12)
    assert maps[-1].shape == (2, 2, 9, 9)
    assert [s.name for s in maps] == ["blocks.1.self_attn"]


def test_capture_encoder_decoder_self_and_cross_with_padding():
    cfg = TransformerConfig(src_vocab_size=15, tgt_vocab_size=17,
                            block={"d_model": 32, "n_head": 4, "d_ff": 64, "dropout": 0.0},
                            n_encoder_layers=2, n_decoder_layers=1)
    model = Transformer(cfg).eval()
    src, tgt = torch.randint(3, 15, (2, 7)), torch.randint(3, 17, (2, 5))
    lengths = torch.tensor([7, 4])
    with capture(model, heads=[2]) as maps:
        model(src, tgt, src_lengths=lengths)
    assert maps.stacks() == ["encoder", "decoder"]
    cross = maps.get(0, cross=True)
    assert cross.is_cross and cross.weights.shape == (2, 1, 5, 7)
    assert torch.all(cross.weights[1, :, :, 4:] == 0)  # padded source keys get no weight
    torch.testing.assert_close(cross.weights.sum(-1), torch.ones(2, 1, 5))
    decoder_self = maps.get(0, stack="decoder").weights
    assert torch.all(decoder_self.triu(1) == 0)  # causal
    assert maps.get(-1, stack="encoder").layer == 1


def test_capture_records_each_call_of_incremental_decoding():
    model = _gpt(n_layer=1)
    with capture(model, heads=0) as maps:
        model.generate(torch.randint(0, 20, (1, 4)), max_new_tokens=3, temperature=0.0)
    calls = maps.get(0).calls
    assert [tuple(c.shape) for c in calls] == [(1, 1, 4, 4), (1, 1, 1, 5), (1, 1, 1, 6)]


def test_capture_encoder_with_padding_and_a_window_feeds_rollout():
    block = {"n_head": 2, "d_model": 16, "dropout": 0.0, "similarity": "cosine"}
    model = Encoder(EncoderConfig(vocab_size=12, num_classes=2, max_len=8, n_layer=2,
                                  block=block, window=2)).eval()
    ids = torch.randint(1, 12, (2, 6))
    plain = model(ids, lengths=torch.tensor([6, 3]))
    with capture(model) as maps:
        assert torch.equal(model(ids, lengths=torch.tensor([6, 3])), plain)
    first = maps[0]
    assert torch.all(first[1, :, :3, 3:] == 0)  # padded keys
    assert torch.all(first[0, :, 0, 3:] == 0)  # outside the window of 2
    rollout = attention_rollout([maps[0], maps[1]])
    torch.testing.assert_close(rollout.sum(-1), torch.ones(2, 6))


def test_capture_vit_keeps_only_asked_heads():
    model = ViT(ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, n_layer=2,
                          block={"d_model": 16, "n_head": 2})).eval()
    with capture(model, layers=0, heads=[1]) as maps:
        model(torch.randn(1, 1, 8, 8))
    assert maps[0].shape == (1, 1, 5, 5)


def test_bad_requests_name_the_valid_range():
    model = _gpt()
    with pytest.raises(ValueError, match=r"layer index 2 .*valid layers are 0\.\.1"):
        with capture(model, layers=[2]):
            pass
    with pytest.raises(ValueError, match=r"head index 4 .*valid heads are 0\.\.3"):
        with capture(model, heads=[4]):
            pass
    with pytest.raises(ValueError, match="unknown stacks"):
        with capture(model, stacks="decoder"):
            pass
    with pytest.raises(TypeError, match="torch.nn.Module"):
        with capture("gpt"):
            pass


@pytest.mark.parametrize("kind", ["linear", "retention"])
def test_attention_without_weights_is_refused_clearly(kind):
    model = _gpt(block={"attention": kind},
                 positions="rope" if kind == "retention" else "learned")
    with pytest.raises(ValueError, match="no attention weights"):
        with capture(model):
            pass


def test_nested_captures_both_record():
    model = _gpt()
    idx = torch.randint(0, 20, (1, 5))
    with capture(model, heads=0) as outer:
        with capture(model, layers=1, heads=[1, 2]) as inner:
            model(idx)
        model(idx)
    assert len(inner.get(1).calls) == 1 and len(outer.get(1).calls) == 2
    assert "attend" not in model.blocks[1].self_attn.__dict__


def test_observers_are_removed_when_the_forward_pass_fails():
    model = _gpt()
    with pytest.raises(ValueError):
        with capture(model):
            model(torch.randint(0, 20, (1, 40)))  # longer than block_size
    assert all("attend" not in b.self_attn.__dict__ for b in model.blocks)
