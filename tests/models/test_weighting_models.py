"""``model.block.weighting`` in every model family: decoding with a KV cache equals the whole
forward, the fused engine equals the reference inside a model, and ``qkv train`` trains
with a weighting from the command line."""

from __future__ import annotations

import pytest
import torch

from qkv.cli import main
from qkv.models import GPT, Encoder, GPTConfig, Transformer, ViT
from qkv.models.configs import EncoderConfig, TransformerConfig, ViTConfig

from ..train.conftest import losses, tiny_lm

WEIGHTINGS = ["sigmoid", "softpick", "stick_breaking", "relu", "identity"]


def _block(weighting: str) -> dict:
    return {"d_model": 16, "n_head": 4, "n_kv_head": 2, "weighting": weighting}


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_gpt_decodes_with_its_cache_as_its_whole_forward(weighting):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=24, n_layer=2, block=_block(weighting),
                          positions={"kind": "rope"})).double().eval()
    idx = torch.randint(0, 30, (2, 12))
    with torch.no_grad():
        whole = model(idx)
        cache = model.new_cache(2, 24)
        steps = [model(idx[:, :5], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("weighting", WEIGHTINGS)
def test_the_fused_engine_equals_the_reference_inside_a_gpt(weighting, monkeypatch):
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=30, block_size=40, n_layer=2,
                          block=_block(weighting))).double()
    idx = torch.randint(0, 30, (2, 40))
    import qkv.nn.attention as layer

    results = []
    for backend in ("fused", "reference"):
        real = layer.attention
        monkeypatch.setattr(layer, "attention",
                            lambda *a, backend=backend, real=real, **kw: real(*a, backend=backend,
                                                                               **kw))
        model.zero_grad()
        loss = model(idx).logsumexp(-1).mean()
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
        monkeypatch.undo()
    for fused, reference in zip(*results, strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("weighting", ["sigmoid", "softpick", "relu"])
def test_every_model_family_takes_a_weighting(weighting):
    torch.manual_seed(2)
    block = _block(weighting)
    encoder = Encoder(EncoderConfig(vocab_size=20, num_classes=0, max_len=10, n_layer=1,
                                    block=block))
    assert encoder(torch.randint(1, 20, (2, 10))).shape[:2] == (2, 10)
    vit = ViT(ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=3, n_layer=1,
                        block=block))
    assert vit(torch.randn(2, 1, 8, 8)).shape == (2, 3)
    translate = Transformer(TransformerConfig(src_vocab_size=20, tgt_vocab_size=20, max_len=10,
                                              n_encoder_layers=1, n_decoder_layers=1,
                                              block=block))
    out = translate(torch.randint(0, 20, (2, 7)), torch.randint(0, 20, (2, 5)))
    assert out.shape == (2, 5, 20) and torch.isfinite(out).all()


def test_kinds_with_their_own_normalization_refuse_a_weighting():
    for kind in ("linear", "retention"):
        with pytest.raises(ValueError, match="weighting must be 'softmax'"):
            GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1,
                          block={"d_model": 8, "n_head": 2, "attention": kind,
                                 "weighting": "sigmoid"}))
    with pytest.raises(ValueError, match="weighting"):
        GPT(GPTConfig(vocab_size=20, block_size=8, n_layer=1,
                      block={"d_model": 8, "n_head": 2, "weighting": "sparsemax"}))


@pytest.mark.slow
@pytest.mark.parametrize("weighting", ["sigmoid", "stick_breaking"])
def test_qkv_train_learns_with_a_weighting(weighting, tmp_path):
    run = tmp_path / weighting
    assert main(tiny_lm(run, 80, "--set", f"model.block.weighting={weighting}")) == 0
    recorded = [loss for _, loss, _ in losses(run)]
    assert sum(recorded[-10:]) / 10 < sum(recorded[:10]) / 10 - 0.6, recorded
