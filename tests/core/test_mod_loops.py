"""The score modifier's C loops: the backward keeps d mod / d score from its recompute (one
evaluation per pair) exactly when no tensor the modifier reads needs a gradient."""

import torch

import qkv
from qkv.core.engines.kernelgen import c_mod


def test_the_slope_is_kept_only_without_tensor_gradients():
    assert c_mod.traced_mod(qkv.softcap(30.0), torch.float32).keeps_slope
    learnable = torch.tensor(30.0, requires_grad=True)
    assert not c_mod.traced_mod(qkv.softcap(learnable), torch.float32).keeps_slope
    # ALiBi's derivative does not read the score: nothing to keep.
    assert not c_mod.traced_mod(qkv.alibi(4), torch.float32).keeps_slope


def test_kept_slope_gives_the_reference_gradients():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 77, 16, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    grads = []
    for backend in ("fused", "reference"):
        out = qkv.attention(q, k, v, score_mod=qkv.softcap(5.0), mask=qkv.causal(),
                            scale=0.3, backend=backend)
        grads.append(torch.autograd.grad((out * out).sum(), (q, k, v)))
    for fused, reference in zip(*grads, strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-10, atol=1e-12)
