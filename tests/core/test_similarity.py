"""Each similarity against an independent expression of its formula, and SDPA parity."""

import math

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.core.problem import build_problem
from qkv.core.similarity import PAIRWISE, pairwise_sum
from qkv.engines import sdpa as sdpa_engine
from qkv.engines.lowering import lower

from .conftest import rand_qkv


def scores_from_weights(q, k, v, **kwargs):
    """Recover the pre-softmax scores up to a per-row constant: log of the returned weights."""
    _, w = qkv.attention(q, k, v, return_weights=True, backend="reference", **kwargs)
    return torch.log(w)


def assert_same_up_to_row_constant(a, b, tol=1e-10):
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def independent_scores(name, q, k, scale, metric=None):
    if name == "dot":
        return scale * torch.einsum("bhqd,bhkd->bhqk", q, k)
    if name == "cosine":
        return scale * F.cosine_similarity(q.unsqueeze(-2), k.unsqueeze(-3), dim=-1, eps=1e-30)
    if name == "l2":
        return -scale * torch.cdist(q, k, p=2) ** 2
    if name == "l1":
        return -scale * torch.cdist(q, k, p=1)
    if name == "mahalanobis":
        b, h, nq, _ = q.shape
        out = torch.empty(b, h, nq, k.shape[2], dtype=q.dtype)
        for bi in range(b):
            for hi in range(h):
                L = metric if metric.dim() == 2 else metric[hi]
                for i in range(nq):
                    for j in range(k.shape[2]):
                        diff = L @ (q[bi, hi, i] - k[bi, hi, j])
                        out[bi, hi, i, j] = -scale * (diff @ diff)
        return out
    raise AssertionError(name)


VARIANTS = [(n, "shared") for n in ("dot", "cosine", "l2", "l1", "mahalanobis")]


@pytest.mark.parametrize("name,metric_shape", VARIANTS + [("mahalanobis", "per_head")])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_similarity_matches_independent_formula(name, scale, metric_shape):
    q, k, v = rand_qkv(h=2, hkv=2, d=4)
    d = q.shape[-1]
    metric = None
    if name == "mahalanobis":
        g = torch.Generator().manual_seed(5)
        shape = (d, d) if metric_shape == "shared" else (2, d, d)
        metric = 0.5 * torch.randn(*shape, generator=g, dtype=torch.float64)
    default = math.sqrt(d) if name == "cosine" else 1 / math.sqrt(d)
    effective = default if scale is None else scale
    got = scores_from_weights(q, k, v, similarity=name, scale=scale, metric=metric)
    assert_same_up_to_row_constant(got, independent_scores(name, q, k, effective, metric))


def test_tensor_scale_per_head_and_its_gradient():
    q, k, v = rand_qkv(h=2, hkv=2)
    temperature = torch.tensor([2.0, 0.5], dtype=torch.float64, requires_grad=True)
    out = qkv.attention(q, k, v, similarity="cosine", scale=temperature)
    expected = qkv.attention(q[:, :1], k[:, :1], v[:, :1], similarity="cosine", scale=2.0)
    torch.testing.assert_close(out[:, :1], expected)
    out.sum().backward()
    assert temperature.grad is not None and torch.all(temperature.grad != 0)


@pytest.mark.parametrize("similarity", ["cosine", "dot", "l2", "l1"])
def test_a_learnable_scale_on_the_fused_engine(similarity):
    """A per-head temperature (Swin V2's cosine attention) under softcap and causal: the
    reference's values and gradients. dot and cosine fold it into the query features, so the
    tiles run without autograd; L2 and L1 cannot (its sign is not known) and keep it."""
    q, k, v = (t.requires_grad_() for t in rand_qkv(h=2, hkv=2, nq=37, nk=37, d=8, dv=4))
    results = []
    for backend in ("fused", "reference"):
        temperature = torch.tensor([2.0, 0.5], dtype=torch.float64, requires_grad=True)
        out = qkv.attention(q, k, v, similarity=similarity, scale=temperature,
                            score_mod=qkv.softcap(3.0), mask=qkv.causal(), backend=backend)
        results.append((out, *torch.autograd.grad((out * out).sum(), (q, k, v, temperature))))
    for fused, reference in zip(*results, strict=True):
        torch.testing.assert_close(fused, reference, rtol=1e-10, atol=1e-12)
    problem = build_problem(q, k, v, similarity=similarity, scale=temperature)
    folded = lower(problem).variant.scale is None
    assert folded == (similarity in ("cosine", "dot"))


def sdpa(q, k, v, **kwargs):
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), **kwargs
    )


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_parity_with_sdpa_float32(backend, hkv):
    q, k, v = rand_qkv(h=4, hkv=hkv, nq=9, nk=9, d=8, dv=8, dtype=torch.float32)
    tol = dict(atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv.attention(q, k, v, backend=backend), sdpa(q, k, v), **tol)
    torch.testing.assert_close(
        qkv.attention(q, k, v, mask=qkv.causal(), backend=backend),
        sdpa(q, k, v, is_causal=True),
        **tol,
    )
    mask = torch.rand(2, 1, 9, 9, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[..., 0] = True  # SDPA gives NaN for empty rows; qkv gives zeros (tested elsewhere)
    torch.testing.assert_close(
        qkv.attention(q, k, v, mask=mask, backend=backend), sdpa(q, k, v, attn_mask=mask), **tol
    )


@pytest.mark.parametrize("mask", [None, "causal"])
def test_cosine_through_sdpa_matches_the_reference(mask):
    # On CUDA the dispatcher sends cosine to SDPA on its unit vectors (engines.sdpa); the same
    # path runs here on CPU, against the reference in float64: output and every gradient,
    # with grouped heads and a KV cache (Nq < Nk, bottom-right causal).
    q, k, v = rand_qkv(h=4, hkv=2, nq=5, nk=9, d=8, dv=6, requires_grad=True)
    kwargs = dict(mask=qkv.causal() if mask else None, similarity="cosine")
    problem = build_problem(q, k, v, score_mod=None, scale=None, metric=None, dropout_p=0.0,
                            return_weights=False, **kwargs)
    out = sdpa_engine.run(problem).out
    ref = qkv.attention(q, k, v, backend="reference", **kwargs)
    w = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v))
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=1e-12)


def test_causal_is_bottom_right_aligned_like_a_kv_cache():
    q, k, v = rand_qkv(nq=3, nk=7, dtype=torch.float32)
    out = qkv.attention(q, k, v, mask=qkv.causal())
    expected = sdpa(q, k, v, attn_mask=torch.ones(3, 7, dtype=torch.bool).tril(4))
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    # The last query of a cache step equals the last row of full causal attention.
    qf, kf, vf = rand_qkv(nq=7, nk=7, dtype=torch.float32, seed=4)
    full = qkv.attention(qf, kf, vf, mask=qkv.causal())
    step = qkv.attention(qf[:, :, -1:], kf, vf, mask=qkv.causal())
    torch.testing.assert_close(step, full[:, :, -1:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("similarity", ["dot", "l1"])
def test_low_precision_dtypes_track_float64(dtype, similarity):
    q, k, v = rand_qkv(dtype=torch.float64)
    ref = qkv.attention(q, k, v, similarity=similarity, score_mod=qkv.softcap(5.0))
    low = qkv.attention(
        q.to(dtype), k.to(dtype), v.to(dtype), similarity=similarity, score_mod=qkv.softcap(5.0)
    )
    assert low.dtype == dtype
    err = (low.double() - ref).norm() / ref.norm()
    assert err < {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 5e-3}[dtype]


@pytest.mark.parametrize("name", sorted(PAIRWISE))
def test_fast_forms_equal_the_terms_definition(name):
    """Each built-in pairwise term's registered torch form, its rows and its derivative by hand
    against the per-dimension definition summed over d (and its autograd derivative)."""
    pair = PAIRWISE[name]
    g = torch.Generator().manual_seed(4)
    q, k = (torch.randn(2, 3, 9, 7, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(2))
    want = pairwise_sum(pair.term, q, k)
    torch.testing.assert_close(pair.matrix(q, k), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(pair.rows(q, k), torch.diagonal(want, dim1=-2, dim2=-1),
                               rtol=1e-12, atol=1e-12)
    ds = torch.randn(want.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(want, (q, k), ds)
    if pair.tile_grads is not None:
        dq, dk = torch.zeros_like(q), torch.zeros_like(k)
        pair.tile_grads(ds, q.detach(), k.detach(), dq, dk)
        torch.testing.assert_close((dq, dk), grads, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scale", [0.3, 2.0, -0.5, 0.0])
@pytest.mark.parametrize("name", sorted(PAIRWISE))
def test_fold_scale_gives_scaled_scores(name, scale):
    """A term's ``fold_scale`` features score ``scale`` times the originals (and gradients
    reach q and k through them); None only where the term cannot absorb the scale."""
    pair = PAIRWISE[name]
    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(2, 3, 9, 7, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(2))
    folded = pair.fold_scale(q, k, scale)
    if scale <= 0 and name != "dot":  # -|q-k| and -‖q-k‖² change sign, or vanish, with s
        assert folded is None
        return
    got, want = pair.scores(*folded), scale * pair.scores(q, k)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    ds = torch.randn(want.shape, generator=g, dtype=torch.float64)
    torch.testing.assert_close(torch.autograd.grad(got, (q, k), ds),
                               torch.autograd.grad(want, (q, k), ds), rtol=1e-10, atol=1e-10)
