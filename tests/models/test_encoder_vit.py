"""Encoder classifier and Vision Transformer: shapes, pooling, padding, export, errors."""

import dataclasses
import json

import pytest
import torch

from qkv.models import Encoder, EncoderConfig, ViT, ViTConfig


def encoder(pooling="mean", positions="learned", block=None, **kw):
    torch.manual_seed(0)
    return Encoder(EncoderConfig(
        vocab_size=30, num_classes=3, max_len=10, n_layer=2,
        block={"n_head": 2, "d_model": 16, **(block or {})}, positions={"kind": positions},
        pooling=pooling, **kw,
    )).eval()


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_encoder_ignores_padding(pooling):
    model = encoder(pooling)
    ids = torch.randint(1, 30, (2, 6), generator=torch.Generator().manual_seed(1))
    padded = torch.cat((ids, torch.zeros(2, 3, dtype=torch.long)), 1)
    with torch.no_grad():
        ref = model(ids)
        assert (model(padded) - ref).abs().max() < 1e-5
        assert (model(padded, lengths=torch.tensor([6, 6])) - ref).abs().max() < 1e-5
    assert ref.shape == (2, 3)


def test_encoder_mean_pooling_is_the_average_of_real_tokens():
    model = encoder("mean", pad_id=None)
    ids = torch.randint(1, 30, (1, 5))
    with torch.no_grad():
        x, keep = model.features(ids)
        assert torch.allclose(model(ids), model.head(x.mean(1)), atol=1e-6)


def test_encoder_choices_and_errors():
    for kw in ({"block": {"similarity": "l1"}, "positions": "rope"},
               {"positions": "alibi", "block": {"norm": "rmsnorm"}},
               {"positions": "relative", "block": {"ffn": "swiglu", "norm_first": False}},
               {"window": 2, "block": {"similarity": "mahalanobis"}}):
        assert encoder(**kw)(torch.randint(1, 30, (2, 7))).shape == (2, 3)
    with pytest.raises(ValueError, match="max_len=10"):
        encoder()(torch.ones(1, 11, dtype=torch.long))
    with pytest.raises(ValueError, match="pooling"):
        EncoderConfig(vocab_size=30, num_classes=3, max_len=10, n_layer=2,
                      block={"n_head": 2, "d_model": 16}, pooling="max")
    config = encoder("cls").config
    assert EncoderConfig(**json.loads(json.dumps(dataclasses.asdict(config)))) == config


def test_encoder_torch_export():
    model = encoder("cls")
    ids = torch.randint(0, 30, (2, 8), generator=torch.Generator().manual_seed(2))
    exported = torch.export.export(model, (ids,))
    with torch.no_grad():
        assert (exported.module()(ids) - model(ids)).abs().max() < 1e-5


def test_vit_shapes_and_rectangular_images():
    torch.manual_seed(0)
    model = ViT(ViTConfig(image_size=[8, 12], patch_size=4, in_channels=3, num_classes=5,
                          n_layer=2, block={"d_model": 16, "n_head": 2})).eval()
    assert model(torch.randn(2, 3, 8, 12)).shape == (2, 5)
    assert model.positions.max_len == 2 * 3 + 1
    mean = ViT(ViTConfig(image_size=8, patch_size=[2, 4], in_channels=1, num_classes=10,
                         n_layer=1, block={"d_model": 16, "n_head": 4, "similarity": "cosine"},
                         pooling="mean"))
    assert mean(torch.randn(3, 1, 8, 8)).shape == (3, 10)


def test_vit_errors():
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        ViTConfig(image_size=10, patch_size=4, in_channels=1, num_classes=10, n_layer=2,
                  block={"d_model": 16, "n_head": 2})
    model = ViT(ViTConfig(image_size=8, patch_size=4, in_channels=1, num_classes=10, n_layer=1,
                          block={"d_model": 16, "n_head": 2}))
    with pytest.raises(ValueError, match=r"\(B, 1, 8, 8\)"):
        model(torch.randn(1, 1, 8, 12))
    with pytest.raises(ValueError, match="float"):
        model(torch.ones(1, 1, 8, 8, dtype=torch.long))
