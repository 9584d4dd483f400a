"""Every documented bad input raises a clear error naming the argument."""

import pytest
import torch

import qkv


def qkv4(b=1, h=2, hkv=2, nq=4, nk=4, d=3, dv=3):
    return torch.randn(b, h, nq, d), torch.randn(b, hkv, nk, d), torch.randn(b, hkv, nk, dv)


@pytest.mark.parametrize(
    "make, error, match",
    [
        (
            lambda: (torch.randn(2, 4, 3), *qkv4()[1:]),
            ValueError,
            r"q must be a 4-D tensor \(B, H, Nq, D\)",
        ),
        (lambda: (qkv4()[0], torch.randn(2, 4, 3), qkv4()[2]), ValueError, "k must be a 4-D"),
        (lambda: (*qkv4()[:2], torch.randn(1, 2, 5, 3)), ValueError, "must agree on B, Hkv and Nk"),
        (lambda: (qkv4(b=2)[0], *qkv4()[1:]), ValueError, "same batch size B"),
        (lambda: (qkv4(d=5)[0], *qkv4()[1:]), ValueError, "same head dim D"),
        (lambda: qkv4(h=3, hkv=2), ValueError, "H=3 must be a multiple of .* Hkv=2"),
        (lambda: (qkv4()[0].int(), *qkv4()[1:]), TypeError, "q must be float64, float32"),
        (lambda: (qkv4()[0].double(), *qkv4()[1:]), TypeError, "share a dtype"),
    ],
)
def test_bad_tensors(make, error, match):
    with pytest.raises(error, match=match):
        qkv.attention(*make())


def test_mask_that_does_not_broadcast():
    with pytest.raises(
        ValueError, match=r"mask of shape \(3, 4\) does not broadcast to \(B, H, Nq, Nk\)"
    ):
        qkv.attention(*qkv4(), mask=torch.ones(3, 4, dtype=torch.bool))


def test_non_bool_mask():
    with pytest.raises(TypeError, match="mask must be a bool or float tensor; got dtype "
                                        "torch.int64"):
        qkv.attention(*qkv4(), mask=torch.ones(4, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="mask must be None, a bool or float tensor, a qkv mask"):
        qkv.attention(*qkv4(), mask="causal")
    with pytest.raises(TypeError, match="mask must be a bool tensor .* An additive float mask "
                                        "goes to qkv.attention as attn_mask= or mask="):
        qkv.causal() & torch.ones(4, 4)


def test_unknown_similarity_lists_valid_ones():
    with pytest.raises(
        ValueError, match="similarity must be one of 'dot', 'cosine', 'l2', 'l1', 'mahalanobis'"
    ):
        qkv.attention(*qkv4(), similarity="manhattan")


def test_negative_window():
    with pytest.raises(ValueError, match="sliding_window: left must be an int >= 0"):
        qkv.sliding_window(-1)
    with pytest.raises(ValueError, match="sliding_window: right must be an int >= 0"):
        qkv.sliding_window(2, -3)


def test_graph_edge_out_of_range():
    with pytest.raises(ValueError, match="edge index out of range"):
        qkv.attention(*qkv4(), mask=qkv.graph(torch.tensor([[0, 5], [1, 2]])))
    with pytest.raises(ValueError, match="edge index out of range"):
        qkv.graph(torch.tensor([[0, 5], [1, 2]]), num_nodes=4)
    with pytest.raises(ValueError, match="must be >= 0"):
        qkv.graph(torch.tensor([[0, -1], [1, 2]]))
    with pytest.raises(ValueError, match=r"integer \(2, E\) tensor"):
        qkv.graph(torch.rand(3, 3))


def test_metric_shape_and_presence():
    q, k, v = qkv4(d=3)
    with pytest.raises(
        ValueError, match=r"metric must have shape \(D, D\)=\(3, 3\) or \(H, D, D\)"
    ):
        qkv.attention(q, k, v, similarity="mahalanobis", metric=torch.eye(4))
    with pytest.raises(ValueError, match="needs metric=L"):
        qkv.attention(q, k, v, similarity="mahalanobis")
    with pytest.raises(ValueError, match="metric is only used with similarity='mahalanobis'"):
        qkv.attention(q, k, v, metric=torch.eye(3))


def test_other_arguments():
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        qkv.attention(*qkv4(), dropout_p=1.5)
    with pytest.raises(TypeError, match="scale must be a finite number"):
        qkv.attention(*qkv4(), scale=float("nan"))
    with pytest.raises(TypeError, match="score_mod must be None, a callable"):
        qkv.attention(*qkv4(), score_mod=3)
    with pytest.raises(ValueError, match="padding: lengths has 2 entries but the batch size is 1"):
        qkv.attention(*qkv4(), mask=qkv.padding([1, 2]))
    with pytest.raises(ValueError, match=r"padding: lengths must be <= Nk=4"):
        qkv.attention(*qkv4(), mask=qkv.padding([9]))
    with pytest.raises(ValueError, match="segments: kv_ids has length 4; expected 5"):
        qkv.attention(
            *qkv4(nk=5),
            mask=qkv.segments(torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)),
        )
    with pytest.raises(ValueError, match="softcap: cap must be a positive number"):
        qkv.softcap(0)


def test_backend_errors():
    with pytest.raises(
        ValueError, match="backend='sdpa' cannot run this request: SDPA computes only the dot"
    ):
        qkv.attention(*qkv4(), similarity="l1", backend="sdpa")
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        qkv.attention(*qkv4(), backend="cuda-magic")


def test_per_head_score_mods_name_both_head_counts():
    with pytest.raises(ValueError, match=r"alibi has 3 slopes \(heads\) but the attention has "
                                         r"4 query heads; use qkv.alibi\(4\)"):
        qkv.attention(*qkv4(h=4, hkv=2), score_mod=qkv.alibi(3))
    table = torch.zeros(8, 3)
    with pytest.raises(ValueError, match="relative_bias has a table for 3 heads but the "
                                         "attention has 2 query heads"):
        qkv.attention(*qkv4(), score_mod=[qkv.softcap(5.0), qkv.relative_bias(table, 8, 16)])


def test_a_zero_head_dim_is_a_value_error():
    with pytest.raises(ValueError, match=r"head dim D of q and k must be at least 1; got q "
                                         r"\(1, 2, 4, 0\)"):
        qkv.attention(*qkv4(d=0))


@pytest.mark.parametrize("backend", ["reference", "fused", "auto"])
def test_a_float64_tensor_in_a_score_mod_keeps_the_call_float32(backend):
    """The modified scores go back to the input dtype, on every engine alike."""
    q, k, v = qkv4(h=4, hkv=4)
    buf64 = torch.tensor([0.5, 1.0, 1.5, 2.0], dtype=torch.float64)
    out = qkv.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * buf64[h], backend=backend)
    expected = qkv.attention(q, k, v, scale=(0.5 + 0.5 * torch.arange(4.0)) / 3**0.5,
                             backend="reference")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("backend", ["reference", "fused", "sdpa"])
def test_nan_in_q_or_k_spoils_only_the_rows_that_read_it(backend):
    """What qkv.attention's docstring says about non-finite inputs."""
    torch.manual_seed(0)
    q, k, v = qkv4(nq=6, nk=6, d=8, dv=8)
    clean = qkv.attention(q, k, v, mask=qkv.causal(), backend=backend)
    bad_k = k.clone()
    bad_k[0, :, 3, 0] = float("nan")
    out = qkv.attention(q, bad_k, v, mask=qkv.causal(), backend=backend)
    torch.testing.assert_close(out[:, :, :3], clean[:, :, :3])
    assert out[:, :, 3:].isnan().all()
    bad_q = q.clone()
    bad_q[0, :, 1, 0] = float("nan")
    out = qkv.attention(bad_q, k, v, mask=qkv.causal(), backend=backend)
    others = [0, 2, 3, 4, 5]
    torch.testing.assert_close(out[:, :, others], clean[:, :, others])
    assert out[:, :, 1].isnan().all() or (backend == "sdpa" and (out[:, :, 1] == 0).all())
