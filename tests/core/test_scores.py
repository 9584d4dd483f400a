"""Score modifiers: ALiBi slopes, T5 buckets (against Hugging Face), softcap, user callables."""

import math

import pytest
import torch

import qkv
from qkv.core.scores import alibi_slopes, relative_position_bucket


def test_alibi_slopes_follow_the_paper():
    assert torch.allclose(alibi_slopes(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    s = alibi_slopes(12)  # not a power of two: 8 slopes, then every other slope of 16
    expected = [2.0 ** -(i + 1) for i in range(8)] + [
        2.0 ** -(0.5 * (i + 1)) for i in range(0, 8, 2)
    ]
    assert torch.allclose(s, torch.tensor(expected))


def test_alibi_bias_is_minus_slope_times_distance_and_kv_cache_aligned():
    q = torch.zeros(1, 2, 4, 3)
    k = torch.zeros(1, 2, 4, 3)
    v = torch.eye(4).view(1, 1, 4, 4).expand(1, 2, 4, 4)
    _, w = qkv.attention(q, k, v, score_mod=qkv.alibi(2), mask=qkv.causal(), return_weights=True)
    slope = alibi_slopes(2)[1]
    row = torch.softmax(-slope * torch.tensor([3.0, 2, 1, 0]), -1)
    assert torch.allclose(w[0, 1, 3], row, atol=1e-6)
    # A single cached query at the end sees the same distances.
    _, w1 = qkv.attention(
        q[:, :, -1:], k, v, score_mod=qkv.alibi(2), mask=qkv.causal(), return_weights=True
    )
    assert torch.allclose(w1[0, 1, 0], row, atol=1e-6)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_bucket_matches_hugging_face_t5(bidirectional):
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 300)
    ours = relative_position_bucket(rel, 32, 128, bidirectional)
    theirs = t5.T5Attention._relative_position_bucket(rel, bidirectional, 32, 128)
    assert torch.equal(ours, theirs)


def test_relative_bias_adds_table_entries_and_learns():
    table = torch.randn(8, 2, requires_grad=True)
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    out = qkv.attention(q, k, v, score_mod=qkv.relative_bias(table, num_buckets=8, max_distance=16))
    out.sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0


def test_softcap_bounds_scores():
    q = torch.randn(1, 1, 3, 4) * 100
    k = torch.randn(1, 1, 3, 4) * 100
    v = torch.eye(3).view(1, 1, 3, 3)
    _, w = qkv.attention(q, k, v, score_mod=qkv.softcap(1.0), return_weights=True)
    # With |score| <= 1 the weights stay within a factor e^2 of each other.
    assert (w.max(-1).values / w.min(-1).values <= math.e**2 + 1e-4).all()


def test_user_callable_and_chain_order():
    q, k, v = (torch.randn(1, 2, 4, 3, dtype=torch.float64) for _ in range(3))

    def double(score, b, h, q_idx, kv_idx):
        return score * 2

    a = qkv.attention(q, k, v, score_mod=[double, qkv.softcap(1.5)])
    b = qkv.attention(q, k, v, score_mod=qkv.softcap(1.5), scale=2 / math.sqrt(3))
    torch.testing.assert_close(a, b)
    c = qkv.attention(q, k, v, score_mod=qkv.softcap(1.5).then(double))
    assert not torch.allclose(a, c)


def test_learnable_alibi_slopes_receive_gradients():
    slopes = torch.nn.Parameter(alibi_slopes(2))
    q, k, v = (torch.randn(1, 2, 4, 3) for _ in range(3))
    qkv.attention(q, k, v, score_mod=qkv.alibi(slopes=slopes)).pow(2).sum().backward()
    assert slopes.grad is not None and slopes.grad.abs().sum() > 0
