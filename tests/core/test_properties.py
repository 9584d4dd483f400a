"""Property tests over random shapes, grouped heads, Nq != Nk and random masks."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.core.similarity import SIMILARITIES

# Registered similarities that apply to any head dim and need no metric (drawn shapes vary).
ANY_D = [name for name, sim in SIMILARITIES.items()
         if not sim.needs_metric and all(t.dim() == 0 for t in sim.tensors())]


def naive_attention(q, k, v, allowed, scale):
    """A direct loop-free statement of masked softmax attention, written independently."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = torch.where(allowed, s, torch.full_like(s, -1e300))
    w = torch.softmax(s, -1) * allowed.any(-1, keepdim=True)
    return w @ v, w


shapes = st.fixed_dictionaries(
    {
        "b": st.integers(1, 3),
        "hkv": st.integers(1, 3),
        "group": st.integers(1, 3),
        "nq": st.integers(1, 9),
        "nk": st.integers(1, 9),
        "d": st.integers(1, 8),
        "dv": st.integers(1, 5),
        "seed": st.integers(0, 10_000),
        "density": st.floats(0.0, 1.0),
    }
)


@settings(max_examples=60, deadline=None)
@given(shapes)
def test_random_masks_match_naive_and_empty_rows_are_zero(s):
    g = torch.Generator().manual_seed(s["seed"])
    h = s["hkv"] * s["group"]
    q = torch.randn(
        s["b"], h, s["nq"], s["d"], generator=g, dtype=torch.float64, requires_grad=True
    )
    k = torch.randn(
        s["b"], s["hkv"], s["nk"], s["d"], generator=g, dtype=torch.float64, requires_grad=True
    )
    v = torch.randn(
        s["b"], s["hkv"], s["nk"], s["dv"], generator=g, dtype=torch.float64, requires_grad=True
    )
    allowed = torch.rand(s["b"], h, s["nq"], s["nk"], generator=g) < s["density"]
    out, w = qkv.attention(q, k, v, mask=allowed, return_weights=True)
    expected, expected_w = naive_attention(q, k, v, allowed, s["d"] ** -0.5)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(w, expected_w)
    empty = ~allowed.any(-1)
    assert (out[empty] == 0).all()
    sums = w.sum(-1)
    torch.testing.assert_close(sums[~empty], torch.ones_like(sums[~empty]))
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[empty] == 0).all()


@settings(max_examples=30, deadline=None)
@given(shapes, st.sampled_from(ANY_D))
def test_mask_objects_equal_their_materialized_bool_tensors(s, similarity):
    g = torch.Generator().manual_seed(s["seed"])
    h = s["hkv"] * s["group"]
    q = torch.randn(s["b"], h, s["nq"], s["d"], generator=g, dtype=torch.float64)
    k = torch.randn(s["b"], s["hkv"], s["nk"], s["d"], generator=g, dtype=torch.float64)
    v = torch.randn(s["b"], s["hkv"], s["nk"], s["dv"], generator=g, dtype=torch.float64)
    lengths = torch.randint(0, s["nk"] + 1, (s["b"],), generator=g)
    mask = (qkv.causal() | qkv.sliding_window(1, 2)) & qkv.padding(lengths)
    dense = mask.materialize(s["b"], h, s["nq"], s["nk"])
    a = qkv.attention(q, k, v, mask=mask, similarity=similarity, score_mod=qkv.alibi(h))
    b = qkv.attention(q, k, v, mask=dense, similarity=similarity, score_mod=qkv.alibi(h))
    torch.testing.assert_close(a, b)


def test_fully_masked_gives_zero_output_and_zero_grads_everywhere():
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True) for _ in range(3))
    for similarity in ANY_D:
        out = qkv.attention(q, k, v, mask=qkv.padding([0]), similarity=similarity)
        assert (out == 0).all()
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all((g == 0).all() for g in grads)


def test_out_equals_returned_weights_times_v_with_dropout():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 4) for _ in range(3))
    out, w = qkv.attention(q, k, v, dropout_p=0.5, return_weights=True, similarity="l2")
    torch.testing.assert_close(out, w @ v)
    assert (w == 0).any()  # some weights were dropped


@settings(max_examples=40, deadline=None)
@given(shapes, st.sampled_from(["sigmoid", "softpick", "stick_breaking", "relu", "identity"]))
def test_weightings_over_random_masks(s, weighting):
    """Masked weights are 0 under every weighting, on the fused engine and the reference
    alike; stick-breaking's rows sum to at most 1, sigmoid's weights lie in (0, 1)."""
    g = torch.Generator().manual_seed(s["seed"])
    h = s["hkv"] * s["group"]
    q = torch.randn(s["b"], h, s["nq"], s["d"], generator=g, dtype=torch.float64)
    k = torch.randn(s["b"], s["hkv"], s["nk"], s["d"], generator=g, dtype=torch.float64)
    v = torch.randn(s["b"], s["hkv"], s["nk"], s["dv"], generator=g, dtype=torch.float64)
    allowed = torch.rand(s["b"], h, s["nq"], s["nk"], generator=g) < s["density"]
    mask = qkv.causal() & allowed if weighting == "stick_breaking" else allowed
    dense = mask.materialize(s["b"], h, s["nq"], s["nk"]) if weighting == "stick_breaking" \
        else allowed
    results = [qkv.attention(q, k, v, mask=mask, weighting=weighting, return_weights=True,
                             backend=backend) for backend in ("fused", "reference")]
    (out, w), (ref_out, ref_w) = results
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w, ref_w, rtol=1e-10, atol=1e-12)
    assert (w[~dense] == 0).all()
    if weighting == "stick_breaking":
        assert (w.sum(-1) <= 1 + 1e-12).all() and (w >= 0).all()
    if weighting == "sigmoid":
        inside = w[dense]
        assert ((inside > 0) & (inside < 1)).all()
