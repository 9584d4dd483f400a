"""The C tile kernels: L1 values and gradients equal torch.cdist's, and the softmax steps
and graph-edge primitives equal their torch formulas."""

import pytest
import torch

import qkv
from qkv.core.similarity import PAIRWISE
from qkv.engines.cpu import native, paths
from qkv.engines.lowering import TermKind, term_kind

pytestmark = pytest.mark.skipif(
    not native.available(torch.float32), reason="no C compiler on this machine"
)


def cdist_reference(q, k, ds):
    q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
    scores = -torch.cdist(q, k, p=1)
    return scores.detach(), *torch.autograd.grad(scores, (q, k), ds)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("m,n,d", [(1, 1, 1), (37, 70, 40), (5, 64, 64), (129, 3, 17)])
def test_scores_and_gradients_equal_cdist(dtype, m, n, d):
    g = torch.Generator().manual_seed(m * n + d)
    q = torch.randn(2, 3, m, d, generator=g, dtype=dtype)
    k = torch.randn(2, 3, n, d, generator=g, dtype=dtype)
    ds = torch.randn(2, 3, m, n, generator=g, dtype=dtype)
    want, want_dq, want_dk = cdist_reference(q, k, ds)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(native.l1_scores(q, k), want, **tol)
    dq, dk = native.l1_grads(ds, q, k)
    torch.testing.assert_close(dq, want_dq, **tol)
    torch.testing.assert_close(dk, want_dk, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ties_have_zero_sign_like_cdist(dtype):
    """Integer-valued features make many q_d == k_d: their sign, and gradient, is 0; so for
    -0 against +0 (their difference can be -0, whose sign bit is set)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-2, 3, (1, 1, 9, 16), generator=g).to(dtype)
    k = torch.randint(-2, 3, (1, 1, 11, 16), generator=g).to(dtype)
    q[..., ::2, 3], q[..., 1::2, 3], k[..., ::2, 3], k[..., 1::2, 3] = -0.0, 0.0, 0.0, -0.0
    ds = torch.randn(1, 1, 9, 11, generator=g, dtype=torch.float64).to(dtype)
    _, want_dq, want_dk = cdist_reference(q, k, ds)
    dq, dk = native.l1_grads(ds, q, k)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(dq, want_dq, rtol=0, atol=tol)
    torch.testing.assert_close(dk, want_dk, rtol=0, atol=tol)


def test_non_contiguous_inputs():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 3, 10, 8, generator=g, dtype=torch.float64).transpose(1, 2)  # (1,10,3,8)
    k = torch.randn(1, 4, 20, 8, generator=g, dtype=torch.float64)[:, :, ::2].transpose(1, 2)
    want = -torch.cdist(q.contiguous(), k.contiguous(), p=1)
    torch.testing.assert_close(native.l1_scores(q, k), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("out_layout", ["slice", "transposed"])
def test_l1_gradients_add_into_tiles_in_place_or_through_a_copy(dtype, out_layout):
    """Tiles sliced along the rows of (B, H, N, d) tensors are read and added into in place;
    outputs whose rows are not contiguous (transposed) go through a zeroed copy. Either way
    the gradients add to what the outputs held, and nothing outside the tile changes."""
    g = torch.Generator().manual_seed(5)
    q_full = torch.randn(2, 3, 40, 16, generator=g, dtype=dtype)
    k_full = torch.randn(2, 3, 50, 16, generator=g, dtype=dtype)
    q, k = q_full[:, :, 8:29], k_full[:, :, 10:42]  # row slices: batch steps 40·16, 50·16
    ds = torch.randn(2, 3, 21, 32, generator=g, dtype=dtype)
    if out_layout == "slice":
        dq_full = torch.randn(2, 3, 40, 16, generator=g, dtype=dtype)
        dk_full = torch.randn(2, 3, 50, 16, generator=g, dtype=dtype)
        dq, dk = dq_full[:, :, 8:29], dk_full[:, :, 10:42]
        assert native.row_view(dq, written=True) is not None
    else:
        dq_full = torch.randn(2, 3, 16, 21, generator=g, dtype=dtype)
        dk_full = torch.randn(2, 3, 16, 32, generator=g, dtype=dtype)
        dq, dk = dq_full.transpose(-1, -2), dk_full.transpose(-1, -2)
        assert native.row_view(dq, written=True) is None
    before = (dq_full.clone(), dk_full.clone())
    held = (dq.clone(), dk.clone())
    native.add_l1_grads(ds, q, k, dq, dk)
    want, want_dq, want_dk = cdist_reference(q, k, ds)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(dq, held[0] + want_dq, **tol)
    torch.testing.assert_close(dk, held[1] + want_dk, **tol)
    torch.testing.assert_close(native.l1_scores(q, k), want, **tol)
    if out_layout == "slice":  # the rows outside the tile are untouched
        for full, old, rows in zip((dq_full, dk_full), before, (slice(8, 29), slice(10, 42)),
                                   strict=True):
            outside = torch.ones(full.shape[2], dtype=torch.bool)
            outside[rows] = False
            assert torch.equal(full[:, :, outside], old[:, :, outside])


def test_row_view_refuses_overlapping_outputs():
    expanded = torch.zeros(1, 1, 4, 8).expand(3, 1, 4, 8)
    assert native.row_view(expanded) is not None  # readable: every item the same rows
    assert native.row_view(expanded, written=True) is None


def test_fused_engine_runs_l1_tiles_in_c(monkeypatch, one_thread):
    """The tile path (the C blocks, which call the same loops from C, are forced off here:
    test_native_blocks.py covers them)."""
    monkeypatch.setattr(paths, "PATHS", paths.PATHS[1:])  # the tiles, not the C blocks
    calls = {"l1_scores": 0, "add_l1_grads": 0}
    for name in calls:
        real = getattr(native, name)

        def counted(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(native, name, counted)
    q, k, v = (torch.randn(1, 2, 33, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kw = {"similarity": "l1", "mask": qkv.causal(), "score_mod": qkv.softcap(3.0)}
    out = qkv.attention(q, k, v, backend="fused", **kw)
    ref = qkv.attention(q, k, v, backend="reference", **kw)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert calls["l1_scores"] > 0 and calls["add_l1_grads"] > 0
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_online_softmax_step_equals_its_torch_formula(dtype):
    """Rows with no allowed key so far (-inf max), fully masked tiles and far scores (exp of
    values below -88, where torch's exp is slow and float32 underflows) included."""
    g = torch.Generator().manual_seed(5)
    s = torch.randn(2, 3, 6, 37, generator=g, dtype=dtype) * 40
    s[0, 0, 1] = float("-inf")  # a fully masked row of the tile
    s[1, 2, :, ::3] = float("-inf")
    row_max = torch.randn(2, 3, 6, 1, generator=g, dtype=dtype) * 40
    row_max[0, 0, :2] = float("-inf")  # rows that have seen nothing yet
    row_sum = torch.rand(2, 3, 6, 1, generator=g, dtype=dtype).masked_fill(row_max.isinf(), 0)
    acc = torch.randn(2, 3, 6, 5, generator=g, dtype=dtype).masked_fill(row_max.isinf(), 0)
    new_max = torch.maximum(row_max, s.amax(-1, keepdim=True))
    safe = new_max.masked_fill(new_max.isinf(), 0)
    want_p = torch.exp(s - safe)
    correction = torch.exp(row_max - safe)
    want_sum = row_sum * correction + want_p.sum(-1, keepdim=True)
    want_acc = acc * correction
    native.online_softmax_step(s, row_max, row_sum, acc)
    tol = {"rtol": 1e-12, "atol": 0} if dtype == torch.float64 else {"rtol": 3e-7, "atol": 1e-30}
    torch.testing.assert_close(s, want_p, **tol)
    torch.testing.assert_close(row_sum, want_sum, **tol)
    torch.testing.assert_close(acc, want_acc, **tol)
    torch.testing.assert_close(row_max, new_max, rtol=0, atol=0)
    assert (s[0, 0, 1] == 0).all() and (s[1, 2, :, ::3] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_exp_sub_rows(dtype):
    g = torch.Generator().manual_seed(6)
    s = torch.randn(4, 9, 50, generator=g, dtype=dtype) * 30
    s[:, :, ::7] = float("-inf")
    lse = s.logsumexp(-1, keepdim=True)
    lse[1, 3] = float("inf")  # a row with no allowed key
    want = torch.exp(s - lse)
    got = native.exp_sub_rows(s.clone(), lse)
    torch.testing.assert_close(got, want, rtol=3e-7 if dtype == torch.float32 else 1e-12,
                               atol=1e-30)
    assert (got[1, 3] == 0).all()


def test_softmax_grad_rows():
    g = torch.Generator().manual_seed(7)
    p = torch.rand(3, 5, 21, generator=g, dtype=torch.float64)
    dp = torch.randn(3, 5, 21, generator=g, dtype=torch.float64)
    delta = torch.randn(3, 5, 1, generator=g, dtype=torch.float64)
    want = p * (dp - delta)
    torch.testing.assert_close(native.softmax_grad_rows(p, dp, delta), want, rtol=1e-14, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_softmax_grad_rows_times_a_modifier_slope(dtype):
    """With a slope: p (dp - delta) · slope · scale, as one product, exactly; 0 where
    p (dp - delta) is 0 (a masked pair), even where the slope is infinite."""
    g = torch.Generator().manual_seed(9)
    p = torch.rand(3, 5, 21, generator=g, dtype=torch.float64).to(dtype)
    p[..., ::4] = 0
    dp = torch.randn(3, 5, 21, generator=g, dtype=torch.float64).to(dtype)
    delta = torch.randn(3, 5, 1, generator=g, dtype=torch.float64).to(dtype)
    slope = torch.rand(3, 5, 21, generator=g, dtype=torch.float64).to(dtype)
    slope[..., ::8] = float("inf")
    plain = p * (dp - delta)
    want = torch.where(plain != 0, plain * slope * torch.tensor(0.3, dtype=dtype), 0)
    got = native.softmax_grad_rows(p, dp.clone(), delta, slope, 0.3)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="slope must be contiguous"):
        native.softmax_grad_rows(p, dp.clone(), delta, slope.transpose(-1, -2))


@pytest.mark.parametrize("mask_shape", [(1, 1, 6, 37), (2, 1, 6, 37), (1, 3, 6, 1), (2, 3, 6, 37)])
def test_softmax_steps_apply_a_broadcast_mask(mask_shape):
    """A forbidden pair counts as -inf whatever its score holds, NaN included."""
    g = torch.Generator().manual_seed(8)
    s = torch.randn(2, 3, 6, 37, generator=g, dtype=torch.float64)
    allowed = torch.rand(mask_shape, generator=g) > 0.4
    allowed[..., 0, :] = False  # a row with nothing allowed
    masked = s.masked_fill(~allowed, float("-inf"))
    s = s.masked_fill(~allowed, float("nan"))
    row_max = torch.full((2, 3, 6, 1), float("-inf"), dtype=torch.float64)
    row_sum, acc = torch.zeros_like(row_max), torch.zeros(2, 3, 6, 4, dtype=torch.float64)
    got = s.clone()
    native.online_softmax_step(got, row_max, row_sum, acc, allowed)
    safe = masked.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    torch.testing.assert_close(got, torch.exp(masked - safe), rtol=1e-12, atol=0)
    torch.testing.assert_close(row_sum, torch.exp(masked - safe).sum(-1, keepdim=True))
    lse = masked.logsumexp(-1, keepdim=True).nan_to_num(neginf=float("inf"))
    got = native.exp_sub_rows(s.clone(), lse, allowed)
    torch.testing.assert_close(got, torch.exp(masked - lse), rtol=1e-12, atol=0)


@pytest.mark.parametrize("pair", sorted(PAIRWISE))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_edge_primitives_equal_their_torch_formulas(pair, dtype):
    """Scores, scatters and kernel gradients along edges, grouped heads (4 query heads on 2
    key heads), against gathering the rows and the term's definition with autograd."""
    pair = PAIRWISE[pair]

    g = torch.Generator().manual_seed(10)
    q_rows = torch.randn(2, 7, 4, 6, generator=g, dtype=dtype)
    k_rows = torch.randn(2, 9, 2, 6, generator=g, dtype=dtype)
    v_rows = torch.randn(2, 9, 2, 3, generator=g, dtype=dtype)
    target = torch.tensor([0, 0, 1, 3, 3, 3, 6])
    source = torch.tensor([4, 8, 0, 1, 1, 7, 2])
    qe = q_rows[:, target].requires_grad_()
    ke = k_rows[:, source].repeat_interleave(2, dim=2).requires_grad_()
    want = pair.rows(qe, ke)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    scores = native.edge_scores(term_kind(pair), q_rows, k_rows, target, source)
    torch.testing.assert_close(scores, want, **tol)
    ds = torch.randn(want.shape, generator=g, dtype=dtype)
    gq, gk = torch.autograd.grad(want, (qe, ke), ds)
    dq, dk = torch.zeros_like(q_rows), torch.zeros_like(k_rows)
    native.edge_kernel_grads(term_kind(pair), ds, q_rows, k_rows, target, source, dq, dk)
    torch.testing.assert_close(dq, torch.zeros_like(dq).index_add_(1, target, gq), **tol)
    want_dk = torch.zeros_like(dk).index_add_(1, source, gk.view(2, 7, 2, 2, 6).sum(3))
    torch.testing.assert_close(dk, want_dk, **tol)
    weights = torch.rand(2, 7, 4, generator=g, dtype=dtype)
    out = torch.zeros(2, 7, 4, 3, dtype=dtype)
    native.edge_scatter(weights, v_rows, source, target, out)
    contrib = weights.unsqueeze(-1) * v_rows[:, source].repeat_interleave(2, dim=2)
    torch.testing.assert_close(out, torch.zeros_like(out).index_add_(1, target, contrib), **tol)


@pytest.mark.skipif(not native.available(torch.float64), reason="no C compiler")
def test_edge_loops_reject_a_term_they_have_no_code_for():
    rows = torch.randn(1, 3, 1, 2, dtype=torch.float64)
    edges = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="no code for pairwise term <TermKind.TRACED: 3>"):
        native.edge_scores(TermKind.TRACED, rows, rows, edges, edges)
    with pytest.raises(ValueError, match="no code for pairwise term None"):
        native.edge_kernel_grads(None, torch.ones(1, 2, 1, dtype=torch.float64), rows, rows,
                                 edges, edges, torch.zeros_like(rows), torch.zeros_like(rows))
