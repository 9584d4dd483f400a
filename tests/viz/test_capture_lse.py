"""Capture rebuilds chosen heads from the log-sum-exp the fused engine saved on the live call."""

import importlib

import torch

import qkv
from qkv.core.problem import build_problem
from qkv.core.reference import reference_attention
from qkv.engines.api import attention_result
from qkv.nn import MultiHeadAttention
from qkv.viz import capture

capture_module = importlib.import_module("qkv.viz.capture")  # the module, not the function


def test_return_lse_hands_over_the_fused_engines_lse():
    q, k, v = (torch.randn(2, 4, 37, 8, dtype=torch.float64) for _ in range(3))
    kw = dict(similarity="l2", mask=qkv.causal() & qkv.padding([37, 0]))
    out, lse = qkv.attention(q, k, v, return_lse=True, **kw)
    assert lse.shape == (2, 4, 37)
    ref_out, _, ref_lse = reference_attention(build_problem(q, k, v, **kw))
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse)  # -inf on the empty rows, too


def test_attention_result_keeps_the_sdpa_route_which_has_no_lse():
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    result = attention_result(q, k, v, mask=qkv.causal())
    assert result.lse is None
    torch.testing.assert_close(result.out, qkv.attention(q, k, v, mask=qkv.causal()))


def test_return_lse_moves_plain_attention_off_sdpa_and_keeps_its_output():
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    out, lse = qkv.attention(q, k, v, mask=qkv.causal(), return_lse=True)
    assert lse.shape == (1, 2, 5) and torch.isfinite(lse).all()
    torch.testing.assert_close(out, qkv.attention(q, k, v, mask=qkv.causal()))


def test_capture_uses_the_saved_lse_and_matches_the_layers_weights(monkeypatch):
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 4, similarity="cosine").eval()
    x = torch.randn(2, 11, 16)
    seen = []
    real = capture_module.head_weights

    def spy(*args, lse=None, **kwargs):
        seen.append(lse is not None)
        return real(*args, lse=lse, **kwargs)

    monkeypatch.setattr(capture_module, "head_weights", spy)
    with torch.no_grad(), capture(layer, heads=[2, 0]) as maps:
        out = layer(x, mask=qkv.causal())
    _, weights = layer(x, mask=qkv.causal(), return_weights=True)
    assert seen == [True]
    torch.testing.assert_close(out, layer(x, mask=qkv.causal()))
    assert maps.sites[0].heads == [0, 2]  # kept in head order
    torch.testing.assert_close(maps[0], weights[:, [0, 2]], rtol=1e-5, atol=1e-6)
