"""Maps of a model with another weighting than softmax are that weighting's weights: the
viewer recomputes chosen heads from each row's own scores (no softmax lse exists)."""

import pytest
import torch

import qkv.nn.attention as layer_module
from qkv.models import GPT, GPTConfig
from qkv.nn import MultiHeadAttention
from qkv.viz import capture
from qkv.viz.weights import head_weights


@pytest.mark.parametrize("weighting", ["sigmoid", "softpick", "stick_breaking", "relu"])
def test_captured_maps_are_the_weights_that_multiplied_v(weighting, monkeypatch):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=32, n_layer=2,
                          block={"d_model": 16, "n_head": 4, "weighting": weighting})
                ).double().eval()
    idx = torch.randint(0, 30, (1, 20))
    with capture(model, layers=[1], heads=[1, 3]) as maps:
        model(idx)
    layer = next(m for m in model.blocks[1].modules() if isinstance(m, MultiHeadAttention))
    seen = {}

    def attend(q, k, v, **kwargs):
        out, weights = layer_module.attention(q, k, v, **{**kwargs, "return_weights": True,
                                                           "backend": "reference"})
        seen["weights"] = weights
        return out, None

    monkeypatch.setattr(layer, "attend", attend)
    with torch.no_grad():
        model(idx)
    torch.testing.assert_close(maps[1][0], seen["weights"][0, [1, 3]], rtol=1e-12, atol=1e-12)
    if weighting != "softpick":  # their rows are not a distribution
        assert not torch.allclose(maps[1][0].sum(-1)[:, 1:], torch.ones(2, 19).double())


def test_head_weights_of_a_per_head_sigmoid_bias_read_the_chosen_heads():
    import qkv

    q, k = torch.randn(1, 4, 6, 8, dtype=torch.float64), torch.randn(1, 4, 6, 8,
                                                                    dtype=torch.float64)
    bias = torch.tensor([-3.0, -1.0, 1.0, 3.0], dtype=torch.float64)
    weighting = qkv.weighting.sigmoid(bias=bias)
    all_heads = qkv.attention(q, k, k, weighting=weighting, return_weights=True,
                              backend="reference")[1]
    chosen = head_weights(q, k, [0, 3], weighting=weighting)
    torch.testing.assert_close(chosen, all_heads[:, [0, 3]], rtol=1e-12, atol=1e-12)
