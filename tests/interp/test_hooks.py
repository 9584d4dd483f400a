"""The models' TransformerLens-named hooks against a hand-written eager GPT in float64:
every activation read, each one written, patterns of chosen heads and rows, gradients, and
layers nobody hooks left bit for bit as they were."""

import pytest
import torch

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
from qkv.viz import capture

from .eager import eager_gpt

SHORTS = ("q", "k", "v", "attn_scores", "pattern", "z", "result")


def gpt(dtype=torch.float64, **block):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=40, block_size=32, n_layer=3,
                       block={"d_model": 32, "n_head": 4, **block})
    return GPT(config).to(dtype).eval()


def name(layer, short):
    where = "" if short.startswith("resid") else "attn."
    return f"blocks.{layer}.{where}hook_{short}"


IDX = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))


def test_every_activation_matches_eager():
    model = gpt()
    seen = {}
    want = eager_gpt(model, IDX, seen=seen)
    logits, cache = model.run_with_cache(IDX)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-12)
    assert set(cache) == set(model.hook_names())
    for (layer, short), tensor in seen.items():
        torch.testing.assert_close(cache[name(layer, short)], tensor, rtol=0, atol=1e-12)
    assert cache["pattern", 2] is cache["blocks.2.attn.hook_pattern"]


def test_reading_leaves_the_forward_bit_for_bit():
    model = gpt(torch.float32)
    with torch.no_grad():
        plain = model(IDX)
        hooked, _ = model.run_with_cache(IDX, names_filter=lambda n: True)
    assert torch.equal(plain, hooked)
    assert not model.blocks[0].self_attn.observed  # the wrapper is gone after the call


def test_chosen_heads_and_rows():
    model = gpt()
    seen = {}
    eager_gpt(model, IDX, seen=seen)
    _, cache = model.run_with_cache(IDX, names_filter=[name(1, "pattern"),
                                                       name(1, "attn_scores")],
                                    heads=[3, 1], rows=(2, 9))
    assert set(cache) == {name(1, "pattern"), name(1, "attn_scores")}
    for short in ("pattern", "attn_scores"):
        torch.testing.assert_close(cache[name(1, short)], seen[(1, short)][:, [1, 3], 2:9],
                                   rtol=0, atol=1e-12)


def test_float32_pattern_from_the_engines_lse():
    model = gpt(torch.float32)
    idx = torch.randint(0, 40, (1, 32))
    seen = {}
    eager_gpt(model, idx, seen=seen)
    with torch.no_grad():
        _, cache = model.run_with_cache(idx, names_filter=name(0, "pattern"), heads=[2])
    torch.testing.assert_close(cache[name(0, "pattern")].double(), seen[(0, "pattern")][:, [2]],
                               rtol=0, atol=1e-5)


def _uniform(w):
    w = torch.ones_like(w).tril()
    return w / w.sum(-1, keepdim=True)


EDITS = {
    "q": lambda t: t * 1.5,
    "k": lambda t: t.flip(1),
    "v": lambda t: t + 0.3,
    "attn_scores": lambda s: s * 0.5,
    "pattern": _uniform,
    "z": lambda z: z * torch.tensor([1.0, 0.0, -1.0, 2.0], dtype=z.dtype).view(1, 1, 4, 1),
    "result": lambda r: r * 2.0,
    "resid_pre": lambda x: x * 0.5,
    "resid_post": lambda x: x.roll(1, 1),
}


@pytest.mark.parametrize("short", list(EDITS))
def test_each_write_matches_eager(short):
    model = gpt()
    fn = EDITS[short]
    want = eager_gpt(model, IDX, edits={(1, short): fn})
    got = model.run_with_hooks(IDX, fwd_hooks=[(name(1, short), lambda t, hook: fn(t))])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-11)


def test_written_pattern_of_one_head_and_rows():
    model = gpt()

    def edit(w):
        w = w.clone()
        w[:, 2, 4:10] = _uniform(w)[:, 2, 4:10]
        return w

    want = eager_gpt(model, IDX, edits={(0, "pattern"): edit})
    got = model.run_with_hooks(IDX, fwd_hooks=[(name(0, "pattern"), lambda w, h: _uniform(
        torch.ones(2, 1, 12, 12, dtype=w.dtype))[:, :, 4:10])], heads=[2], rows=(4, 10))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def _retained(w):
    w.retain_grad()
    return w


def test_gradients_flow_through_a_hooked_pattern():
    model = gpt()
    idx = IDX[:1]
    seen = {}
    logits = eager_gpt(model, idx, edits={(1, "pattern"): _retained}, seen=seen)
    logits[0, -1, 3].backward()
    want = seen[(1, "pattern")].grad
    grads = {}

    def keep(w, hook):
        w.retain_grad()
        grads["w"] = w
        return w

    model.run_with_hooks(idx, fwd_hooks=[(name(1, "pattern"), keep)])[0, -1, 3].backward()
    torch.testing.assert_close(grads["w"].grad, want, rtol=0, atol=1e-12)


def test_sigmoid_weighting():
    model = gpt(weighting="sigmoid")
    seen = {}
    want = eager_gpt(model, IDX, seen=seen, sigmoid=True)
    logits, cache = model.run_with_cache(IDX, names_filter=name(2, "pattern"), heads=[0, 1])
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(cache[name(2, "pattern")], seen[(2, "pattern")][:, :2],
                               rtol=0, atol=1e-12)
    half = lambda s: s * 0.5  # noqa: E731
    want = eager_gpt(model, IDX, edits={(2, "attn_scores"): half}, sigmoid=True)
    got = model.run_with_hooks(IDX, fwd_hooks=[(name(2, "attn_scores"), lambda s, h: half(s))])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_grouped_rope_pattern_matches_capture():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=40, block_size=32, n_layer=2, positions={"kind": "rope"},
                          block={"d_model": 32, "n_head": 4, "n_kv_head": 2})).eval()
    idx = torch.randint(0, 40, (2, 20))
    with torch.no_grad(), capture(model, layers=[1], heads=[1, 2]) as maps:
        model(idx)
    with torch.no_grad():
        _, cache = model.run_with_cache(idx, names_filter=[name(1, "pattern"), name(1, "k")],
                                        heads=[1, 2])
    torch.testing.assert_close(cache[name(1, "pattern")], maps[1], rtol=0, atol=1e-6)
    assert cache[name(1, "k")].shape == (2, 20, 2, 8)


def test_last_only_with_a_hooked_last_layer():
    model = gpt()
    want = model(IDX)[:, -1:]
    got, cache = model.run_with_cache(IDX, names_filter=name(2, "pattern"), last_only=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert cache[name(2, "pattern")].shape == (2, 4, 12, 12)


def test_encoder_padding_and_transformer_names():
    torch.manual_seed(0)
    enc = Encoder(EncoderConfig(vocab_size=30, max_len=16, num_classes=0, n_layer=2,
                                block={"d_model": 16, "n_head": 2})).double().eval()
    ids = torch.randint(1, 30, (2, 8))
    lengths = torch.tensor([8, 5])
    plain = enc(ids, lengths)
    out, cache = enc.run_with_cache(ids, lengths, names_filter=name(0, "pattern"))
    w = cache[name(0, "pattern")]
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2, 8, dtype=w.dtype))
    assert w[1, :, :, 5:].abs().max() == 0
    same = enc.run_with_hooks(ids, lengths, fwd_hooks=[(name(0, "pattern"), lambda w, h: w)])
    torch.testing.assert_close(same, plain, rtol=0, atol=1e-12)
    translate = Transformer(TransformerConfig(20, 20, n_encoder_layers=1, n_decoder_layers=1,
                                              block={"d_model": 16, "n_head": 2})).eval()
    assert {"encoder.0.attn.hook_pattern", "decoder.0.attn.hook_z",
            "decoder.0.cross_attn.hook_pattern", "decoder.0.hook_resid_post"} <= set(
                translate.hook_names())
    src, tgt = torch.randint(3, 20, (2, 7)), torch.randint(3, 20, (2, 5))
    with torch.no_grad():
        out, cache = translate.run_with_cache(src, tgt)
        assert torch.equal(out, translate(src, tgt))
    assert cache["decoder.0.cross_attn.hook_pattern"].shape == (2, 2, 5, 7)


def test_vit():
    torch.manual_seed(0)
    vit = ViT(ViTConfig(image_size=8, patch_size=4, in_channels=3, num_classes=5, n_layer=2,
                        block={"d_model": 16, "n_head": 2})).double().eval()
    images = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    plain = vit(images)
    out, cache = vit.run_with_cache(images, names_filter=name(1, "pattern"))
    assert torch.equal(out, plain)
    assert cache["pattern", 1].shape == (2, 2, 5, 5)  # the class token and 4 patches
    torch.testing.assert_close(cache["pattern", 1].sum(-1), torch.ones(2, 2, 5,
                                                                      dtype=torch.float64))


def test_errors_name_the_argument():
    model = gpt()
    with pytest.raises(ValueError, match="no hook named"):
        model.run_with_hooks(IDX, fwd_hooks=[("blocks.0.attn.hook_nope", print)])
    with pytest.raises(ValueError, match="must return None or a tensor of shape"):
        model.run_with_hooks(IDX, fwd_hooks=[(name(0, "z"), lambda z, h: z[:, :1])])
    with pytest.raises(ValueError, match="heads must be in 0..3"):
        model.run_with_cache(IDX, names_filter=name(0, "pattern"), heads=[4])
    with pytest.raises(ValueError, match="rows must be"):
        model.run_with_cache(IDX, names_filter=name(0, "pattern"), rows=(5, 40))
    with pytest.raises(ValueError, match="names_filter names no hook"):
        model.run_with_cache(IDX, names_filter=["blocks.9.hook_resid_post"])
