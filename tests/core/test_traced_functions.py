"""torch.square, torch.sign, torch.relu and torch.rsqrt, and the method spellings of the
operators (q.sub(k), x.pow(2), ...), in a user's term or score modifier trace into the kernel
generators (no fallback to torch on tiles), with torch's values on special inputs and the
reference's gradients; FlexAttention's mask combinators trace too."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, noop_mask, or_masks

import qkv
from qkv.core.scores import UserScoreMod
from qkv.engines.cpu import native
from qkv.engines.kernelgen import c as c_target
from qkv.engines.kernelgen import c_mod
from qkv.engines.kernelgen.graph import CompileError, Graph
from qkv.engines.kernelgen.trace import trace_mask, trace_term

from .conftest import rand_qkv, rel_err

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not native.available(torch.float32), reason="no C compiler")]


def term(q, k):
    return -torch.relu(q - k).square() - 0.5 * torch.sign(q - k) * (k * k + 1).rsqrt()


def methods(q, k):
    x = q.sub(k).abs().pow(2).mul(0.5).add(1, alpha=2)
    return -x.reciprocal().div(2) - F.relu(q.subtract(k), inplace=False).multiply(k)


def mod(score, b, h, q_idx, kv_idx):
    return score - 0.5 * torch.relu(score - 1.0) + 0.1 * torch.sign(score) + score.square() / 64


def _grads(dtype, backend, **kwargs):
    q, k, v = (t.to(dtype).requires_grad_() for t in rand_qkv(1, 2, 2, 19, 23, 6, 3, seed=7))
    out = qkv.attention(q, k, v, mask=qkv.causal(), backend=backend, **kwargs)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(8),
                           dtype=torch.float64).to(dtype)
    return (out, *torch.autograd.grad(out, (q, k, v), upstream))


@pytest.mark.parametrize("kind", ["term", "methods", "score_mod"])
def test_they_trace_to_c_and_match_the_reference(kind):
    kwargs = ({"similarity": qkv.Similarity({"term": term, "methods": methods}[kind])}
              if kind != "score_mod" else {"score_mod": UserScoreMod(mod)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a term that does not trace warns
        if kind != "score_mod":
            assert c_target.traced_loops(kwargs["similarity"].pairwise, torch.float32, 6)
        else:
            assert c_mod.traced_mod(kwargs["score_mod"], torch.float32) is not None
        fused64, fused32 = _grads(torch.float64, "fused", **kwargs), _grads(torch.float32,
                                                                          "fused", **kwargs)
    ref = _grads(torch.float64, "reference", **kwargs)
    for a, b, r in zip(fused64, fused32, ref, strict=True):
        assert rel_err(a, r) < 1e-12
        assert rel_err(b, r) < 1e-5


def test_sign_and_relu_keep_torchs_values_on_special_inputs():
    """NaN gives 0 under sign and NaN under relu; -0 gives +0 under sign and -0 under relu."""
    special = torch.tensor([-0.0, 0.0, float("nan"), -2.0, 3.0, float("inf"), -float("inf")])
    for fn in (torch.sign, torch.relu, torch.square):
        loops = c_mod.traced_mod(UserScoreMod(lambda s, b, h, q, kv, fn=fn: fn(s)), torch.float32)
        tile = special.repeat(1, 1, 1, 1).contiguous()
        out = loops.scores(tile.clone(), torch.empty_like(tile), 0, 0, 0, 1.0)
        want = fn(tile)
        assert torch.equal(out.isnan(), want.isnan())
        kept = ~want.isnan()
        assert torch.equal(out[kept], want[kept])
        assert torch.equal(torch.signbit(out[kept]), torch.signbit(want[kept])), fn


def test_a_rounding_mode_that_does_not_compile_is_named():
    with pytest.raises(CompileError, match="rounding_mode='trunc'"):
        trace_term(lambda q, k: q.div(k, rounding_mode="trunc"), Graph("cpu", 4))


def test_flex_attentions_mask_combinators_trace():
    def causal(b, h, q, kv):
        return q >= kv

    for rule in (and_masks(causal, noop_mask), or_masks(causal, noop_mask), noop_mask):
        trace_mask(qkv.custom_mask(rule), Graph("cpu"))
    with pytest.raises(CompileError, match=r"shape \(2,\)"):
        trace_mask(qkv.custom_mask(lambda b, h, q, kv: b.new_ones((2,)) > 0), Graph("cpu"))
