"""Linear attention: the quadratic, chunkwise and recurrent forms agree; FAVOR+ converges to
softmax attention as features grow; bad input is refused clearly."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.core.linear import (
    LinearState,
    draw_orthogonal_features,
    linear_attention,
    linear_attention_step,
    quadratic_linear_attention,
    read_state,
    recurrent_linear_attention,
    summarize_keys,
)


def qkv_tensors(b=2, h=2, hkv=2, n=13, d=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, n, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, n, dv, generator=g, dtype=dtype)
    return q, k, v


def map_kwargs(kind, d=8, m=24):
    if kind == "elu":
        return {"feature_map": "elu"}
    g = torch.Generator().manual_seed(7)
    return {"feature_map": "favor", "projection": draw_orthogonal_features(m, d, generator=g,
                                                                           dtype=torch.float64)}


def max_err(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind", ["elu", "favor"])
@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64])
def test_causal_forms_agree_float64(kind, chunk):
    q, k, v = qkv_tensors(h=4, hkv=2)
    kw = map_kwargs(kind)
    quadratic = quadratic_linear_attention(q, k, v, causal=True, **kw)
    chunked = linear_attention(q, k, v, causal=True, chunk_size=chunk, **kw)
    recurrent, _ = recurrent_linear_attention(q, k, v, **kw)
    assert max_err(chunked, quadratic) < 1e-10
    assert max_err(recurrent, quadratic) < 1e-10


@pytest.mark.parametrize("kind", ["elu", "favor"])
def test_non_causal_matches_quadratic(kind):
    q, k, v = qkv_tensors()
    kw = map_kwargs(kind)
    reference = quadratic_linear_attention(q, k, v, **kw)
    assert max_err(linear_attention(q, k, v, **kw), reference) < 1e-10


@pytest.mark.parametrize("causal", [False, True])
def test_key_mask_drops_keys(causal):
    """Masked keys contribute nothing: same as the quadratic form with those keys cut out."""
    q, k, v = qkv_tensors(b=2, n=9)
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[0, :3] = False  # left padding of row 0
    out = linear_attention(q, k, v, causal=causal, chunk_size=4, key_mask=keep)
    quadratic = quadratic_linear_attention(q, k, v, causal=causal, key_mask=keep)
    assert max_err(out, quadratic) < 1e-10
    row0 = quadratic_linear_attention(q[:1, :, 3:], k[:1, :, 3:], v[:1, :, 3:], causal=causal)
    assert max_err(out[:1, :, 3:], row0) < 1e-10
    assert max_err(out[1:], linear_attention(q[1:], k[1:], v[1:], causal=causal)) < 1e-10


def test_summary_then_read_is_non_causal_attention():
    q, k, v = qkv_tensors(h=4, hkv=2)
    kw = map_kwargs("favor")
    state = summarize_keys(k, v, 4, **kw)
    assert max_err(read_state(q, state, **kw), linear_attention(q, k, v, **kw)) < 1e-12


@settings(max_examples=15, deadline=None)
@given(n=st.integers(1, 20), split=st.integers(0, 20), chunk=st.integers(1, 8))
def test_state_carried_across_pieces(n, split, chunk):
    split = min(split, n)
    q, k, v = qkv_tensors(b=1, n=n, seed=n)
    whole = linear_attention(q, k, v, causal=True, chunk_size=chunk)
    first, state = linear_attention(
        q[:, :, :split], k[:, :, :split], v[:, :, :split], causal=True, chunk_size=chunk,
        return_state=True,
    )
    second, _ = linear_attention(
        q[:, :, split:], k[:, :, split:], v[:, :, split:], causal=True, chunk_size=chunk,
        state=state, return_state=True,
    )
    assert max_err(torch.cat([first, second], 2), whole) < 1e-10


def test_prefill_then_steps_match_full_sequence():
    q, k, v = qkv_tensors(n=10)
    full = linear_attention(q, k, v, causal=True, chunk_size=3)
    _, state = linear_attention(q[:, :, :6], k[:, :, :6], v[:, :, :6], causal=True,
                                return_state=True)
    for i in range(6, 10):
        out, state = linear_attention_step(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1],
                                           state)
        assert max_err(out, full[:, :, i:i + 1]) < 1e-10


@pytest.mark.parametrize("kind", ["elu", "favor"])
def test_gradients_of_forms_agree(kind):
    kw = map_kwargs(kind)
    grads = []
    for form in ("quadratic", "chunked", "recurrent"):
        q, k, v = (t.requires_grad_() for t in qkv_tensors(n=9))
        if form == "quadratic":
            out = quadratic_linear_attention(q, k, v, causal=True, **kw)
        elif form == "chunked":
            out = linear_attention(q, k, v, causal=True, chunk_size=4, **kw)
        else:
            out, _ = recurrent_linear_attention(q, k, v, **kw)
        out.pow(2).sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            assert max_err(a, b) < 1e-9


def test_gradcheck_chunked():
    q, k, v = (t.requires_grad_() for t in qkv_tensors(b=1, h=1, hkv=1, n=5, d=3, dv=2))
    assert torch.autograd.gradcheck(
        lambda q, k, v: linear_attention(q, k, v, causal=True, chunk_size=2), (q, k, v)
    )


def favor_error(q, k, v, exact, projection) -> float:
    approx = linear_attention(q, k, v, feature_map="favor", projection=projection, eps=0.0)
    return ((approx - exact).norm() / exact.norm()).item()


def test_favor_error_falls_as_features_grow():
    """FAVOR+ estimates exp(q·k/√D): the relative error against softmax attention, averaged
    over projection draws, keeps falling (about 1/√M) as M grows, and orthogonal features do
    better than i.i.d. Gaussian ones."""
    q, k, v = qkv_tensors(b=1, h=2, n=32, d=8, dv=8, seed=3)
    q, k = q * 0.5, k * 0.5
    exact = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v
    errors, iid_errors = [], []
    for m in (16, 64, 256, 1024, 4096):
        gens = [torch.Generator().manual_seed(seed) for seed in range(6)]
        orth = [draw_orthogonal_features(m, 8, generator=g, dtype=torch.float64) for g in gens]
        iid = [torch.randn(m, 8, generator=g, dtype=torch.float64) for g in gens]
        errors.append(sum(favor_error(q, k, v, exact, p) for p in orth) / len(orth))
        iid_errors.append(sum(favor_error(q, k, v, exact, p) for p in iid) / len(iid))
    assert all(b < 0.8 * a for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[-1] < 0.15 * errors[0], errors
    assert sum(errors) < sum(iid_errors), (errors, iid_errors)


def test_orthogonal_features_are_orthogonal_within_blocks():
    proj = draw_orthogonal_features(8, 8, generator=torch.Generator().manual_seed(0),
                                    dtype=torch.float64)
    directions = proj / proj.norm(dim=1, keepdim=True)
    assert max_err(directions @ directions.T, torch.eye(8, dtype=torch.float64)) < 1e-12


def test_float32_close_to_float64():
    q, k, v = qkv_tensors(n=40)
    ref = linear_attention(q, k, v, causal=True, chunk_size=8)
    out = linear_attention(q.float(), k.float(), v.float(), causal=True, chunk_size=8)
    assert max_err(out.double(), ref) < 1e-5


@pytest.mark.parametrize("kind", ["elu", "favor"])
def test_half_precision_runs_in_float32(kind):
    q, k, v = (t.to(torch.bfloat16) for t in qkv_tensors(n=70))
    kw = map_kwargs(kind)
    out, state = linear_attention(q, k, v, causal=True, chunk_size=16, return_state=True, **kw)
    ref = linear_attention(q.double(), k.double(), v.double(), causal=True, **kw)
    assert out.dtype == torch.bfloat16 and state.kv.dtype == torch.float32
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("chunk", [0, -3, 2.0, True])
def test_chunk_size_must_be_positive(chunk):
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        linear_attention(q, k, v, causal=True, chunk_size=chunk)


def test_zero_features_refused():
    with pytest.raises(ValueError, match="num_features must be a positive int; got 0"):
        draw_orthogonal_features(0, 8)
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="projection must have shape"):
        linear_attention(q, k, v, feature_map="favor", projection=torch.zeros(0, 8))


def test_weights_refused_with_pointer():
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="no attention weights.*quadratic_linear_attention"):
        linear_attention(q, k, v, return_weights=True)


def test_other_bad_inputs():
    q, k, v = qkv_tensors()
    with pytest.raises(ValueError, match="feature_map must be one of"):
        linear_attention(q, k, v, feature_map="relu")
    with pytest.raises(ValueError, match="needs projection"):
        linear_attention(q, k, v, feature_map="favor")
    with pytest.raises(ValueError, match="Nq == Nk"):
        linear_attention(q[:, :, :3], k, v, causal=True)
    with pytest.raises(ValueError, match="must agree on B, Hkv and Nk"):
        linear_attention(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="must agree on B and D"):
        linear_attention(q[..., :3], k, v)
    with pytest.raises(ValueError, match="H=2 must be a multiple of Hkv=3"):
        summarize_keys(torch.zeros(1, 3, 4, 8), torch.zeros(1, 3, 4, 8), 2)
    with pytest.raises(ValueError, match="state does not fit"):
        linear_attention(q, k, v, causal=True, state=LinearState(torch.zeros(1), torch.zeros(1)))
