"""Retention: parallel, recurrent and chunkwise forms agree (with carried state), gradients
flow through each, and the decay matrix is the definition."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.core.retention import (
    decay_matrix,
    retention,
    retention_decays,
    retention_scores,
    retention_step,
)


def qkv_tensors(b=2, h=4, hkv=4, n=13, d=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, n, dv, generator=g, dtype=dtype)
    return q, k, v


def loop_definition(q, k, v, gamma, causal=True):
    """out_n = Σ_m γ^(n-m) (q_n·k_m/√D) v_m, written as plainly as possible."""
    b, h, n, d = q.shape
    out = torch.zeros(b, h, n, v.shape[-1], dtype=q.dtype)
    for i in range(n):
        for j in range(n):
            if causal and j > i:
                continue
            w = gamma.view(1, -1, 1) ** abs(i - j) * (q[:, :, i] * k[:, :, j]).sum(-1, keepdim=True)
            out[:, :, i] += w * v[:, :, j] / d**0.5
    return out


def max_err(a, b):
    return (a - b).abs().max().item()


GAMMA = retention_decays(4, dtype=torch.float64)


def test_decays_are_retnets():
    assert torch.allclose(GAMMA, 1 - 2 ** (-5 - torch.arange(4, dtype=torch.float64)))


@pytest.mark.parametrize("causal", [True, False])
def test_parallel_is_the_definition(causal):
    q, k, v = qkv_tensors(n=7)
    out = retention(q, k, v, GAMMA, form="parallel", causal=causal)
    assert max_err(out, loop_definition(q, k, v, GAMMA, causal)) < 1e-12


@pytest.mark.parametrize("chunk", [1, 3, 4, 13, 50])
def test_three_forms_agree_float64(chunk):
    q, k, v = qkv_tensors()
    parallel = retention(q, k, v, GAMMA, form="parallel")
    chunked = retention(q, k, v, GAMMA, form="chunkwise", chunk_size=chunk)
    recurrent = retention(q, k, v, GAMMA, form="recurrent")
    assert max_err(chunked, parallel) < 1e-10
    assert max_err(recurrent, parallel) < 1e-10


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "recurrent"])
def test_bidirectional_forms_agree(form):
    q, k, v = qkv_tensors(n=11)
    ref = retention(q, k, v, GAMMA, form="parallel", causal=False)
    assert max_err(retention(q, k, v, GAMMA, form=form, causal=False, chunk_size=4), ref) < 1e-10


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 24), split=st.integers(0, 24), chunk=st.integers(1, 9),
       forms=st.sampled_from([("chunkwise", "chunkwise"), ("parallel", "chunkwise"),
                              ("chunkwise", "recurrent"), ("recurrent", "parallel")]))
def test_state_carried_across_calls(n, split, chunk, forms):
    split = min(split, n)
    q, k, v = qkv_tensors(b=1, n=n, seed=n)
    whole, whole_state = retention(q, k, v, GAMMA, form="parallel", return_state=True)
    first, state = retention(q[:, :, :split], k[:, :, :split], v[:, :, :split], GAMMA,
                             form=forms[0], chunk_size=chunk, return_state=True)
    second, state = retention(q[:, :, split:], k[:, :, split:], v[:, :, split:], GAMMA,
                              form=forms[1], chunk_size=chunk, state=state, return_state=True)
    assert max_err(torch.cat([first, second], 2), whole) < 1e-10
    assert max_err(state, whole_state) < 1e-10


def test_steps_after_prefill_match_parallel():
    q, k, v = qkv_tensors(n=10, h=4, hkv=2)
    full = retention(q, k, v, GAMMA, form="parallel")
    _, state = retention(q[:, :, :6], k[:, :, :6], v[:, :, :6], GAMMA, return_state=True)
    for i in range(6, 10):
        sl = slice(i, i + 1)
        out, state = retention_step(q[:, :, sl], k[:, :, sl], v[:, :, sl], GAMMA, state)
        assert max_err(out, full[:, :, sl]) < 1e-10


def test_scores_and_decay_matrix():
    q, k, _ = qkv_tensors(n=5)
    d = decay_matrix(GAMMA, 5)
    assert d.shape == (4, 5, 5)
    assert d[1, 4, 2].item() == pytest.approx(GAMMA[1].item() ** 2)
    assert d[0, 1, 3].item() == 0.0
    scores = retention_scores(q, k, GAMMA)
    assert max_err(scores, (q @ k.transpose(-1, -2)) / 8**0.5 * d) < 1e-12


@pytest.mark.parametrize("form", ["parallel", "chunkwise", "recurrent"])
def test_gradients_match_parallel(form):
    grads = {}
    for f in ("parallel", form):
        q, k, v = (t.requires_grad_() for t in qkv_tensors(n=9, h=4, hkv=2))
        state0 = torch.randn(2, 4, 8, 6, generator=torch.Generator().manual_seed(1),
                             dtype=torch.float64, requires_grad=True)
        out, state = retention(q, k, v, GAMMA, form=f, chunk_size=4, state=state0,
                               return_state=True)
        (out.pow(2).sum() + state.sum()).backward()
        grads[f] = [t.grad for t in (q, k, v, state0)]
    for a, b in zip(grads["parallel"], grads[form], strict=True):
        assert max_err(a, b) < 1e-9


def test_gradcheck_chunkwise():
    q, k, v = (t.requires_grad_() for t in qkv_tensors(b=1, h=2, hkv=2, n=5, d=3, dv=2))
    gamma = GAMMA[:2]
    assert torch.autograd.gradcheck(
        lambda q, k, v: retention(q, k, v, gamma, form="chunkwise", chunk_size=2), (q, k, v)
    )


def test_float32_close_to_float64():
    q, k, v = qkv_tensors(n=40)
    ref = retention(q, k, v, GAMMA, chunk_size=8)
    out = retention(q.float(), k.float(), v.float(), GAMMA.float(), chunk_size=8)
    assert max_err(out.double(), ref) < 1e-4


def test_half_precision_runs_in_float32():
    """bfloat16 cannot hold γ = 1 - 2^-8 apart from 1; the decays and state run in float32."""
    q, k, v = (t.to(torch.bfloat16) for t in qkv_tensors(n=300))
    out, state = retention(q, k, v, GAMMA, chunk_size=32, return_state=True)
    ref = retention(q.double(), k.double(), v.double(), GAMMA)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    step, _ = retention_step(q[:, :, :1], k[:, :, :1], v[:, :, :1], GAMMA, None)
    assert step.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk", [0, -1, 1.5])
def test_chunk_size_must_be_positive(chunk):
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        retention(q, k, v, GAMMA, chunk_size=chunk)


def test_weights_refused_pointing_to_decay_matrix():
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="no attention weights.*decay matrix.*decay_matrix"):
        retention(q, k, v, GAMMA, return_weights=True)


def test_other_bad_inputs():
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        retention_decays(0)
    with pytest.raises(ValueError, match=r"gamma must be a tensor of shape \(H,\)"):
        retention(q, k, v, GAMMA[:2])
    with pytest.raises(ValueError, match=r"gamma must lie in \(0, 1\]"):
        retention(q, k, v, torch.tensor([0.5, 1.5, 0.5, 0.5], dtype=torch.float64))
    with pytest.raises(ValueError, match="form must be one of"):
        retention(q, k, v, GAMMA, form="fast")
    with pytest.raises(ValueError, match="state must be a tensor"):
        retention(q, k, v, GAMMA, state=torch.zeros(3))
    with pytest.raises(ValueError, match="causal retention only"):
        retention(q, k, v, GAMMA, causal=False, return_state=True)
