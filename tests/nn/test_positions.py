"""Positions: the paper's sinusoid, RoPE as a relative rotation, ALiBi and T5 bias, limits."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.nn import (
    ALiBiPositions,
    LearnedPositions,
    PositionsConfig,
    RelativePositions,
    RotaryEmbedding,
    RotaryPositions,
    make_positions,
    sinusoidal_encoding,
)


def test_sinusoid_is_the_papers_closed_form():
    d = 10
    pe = sinusoidal_encoding(torch.arange(50), d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert pe[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert pe[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)
    with pytest.raises(ValueError, match="even d_model"):
        sinusoidal_encoding(torch.arange(3), 5)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(0, 500), n=st.integers(0, 500), shift=st.integers(0, 1000))
def test_rope_preserves_norms_and_depends_on_offset_only(m, n, shift):
    rope = RotaryEmbedding(8)
    g = torch.Generator().manual_seed(m * 1000 + n)
    q, k = torch.randn(2, 1, 1, 8, generator=g).split(1)
    qm, kn = rope(q, torch.tensor([m])), rope(k, torch.tensor([n]))
    assert torch.allclose(qm.norm(), q.norm(), rtol=1e-5)
    qs, ks = rope(q, torch.tensor([m + shift])), rope(k, torch.tensor([n + shift]))
    dot, shifted = (qm * kn).sum(), (qs * ks).sum()
    assert abs(dot.item() - shifted.item()) < 1e-3 * (1 + q.norm().item() * k.norm().item())


def test_rope_per_row_positions_and_zero_is_identity():
    rope = RotaryEmbedding(4)
    x = torch.randn(2, 3, 5, 4)
    assert torch.equal(rope(x, torch.zeros(5, dtype=torch.long)), x)
    rows = torch.stack((torch.arange(5), torch.arange(5) + 2))
    out = rope(x, rows)
    assert torch.allclose(out[1], rope(x[1:], torch.arange(5) + 2)[0])


def test_alibi_and_relative_come_as_score_modifiers():
    alibi = ALiBiPositions(n_head=4)
    relative = RelativePositions(n_head=4)
    assert alibi.embed(torch.arange(3)) is None and alibi.rotary() is None
    q = torch.randn(1, 4, 5, 2)
    ref = qkv.attention(q, q, q, score_mod=qkv.alibi(4))
    assert torch.allclose(qkv.attention(q, q, q, score_mod=alibi.score_mod()), ref)
    mod = relative.score_mod()
    assert mod.tensors()[0] is relative.bias_table
    qkv.attention(q, q, q, score_mod=mod).sum().backward()
    # The same attention in float64, written out: T5's buckets for distances under 8 (half
    # of the 32 bidirectional buckets, then the exact range) are 16 * (key after query) + |d|.
    table = relative.bias_table.detach().double().requires_grad_()
    distance = torch.arange(5)[None, :] - torch.arange(5)[:, None]  # key - query
    bucket = 16 * (distance > 0) + distance.abs()
    q64 = q.double()
    scores = q64 @ q64.transpose(-1, -2) / math.sqrt(2) + table[bucket].permute(2, 0, 1)
    (scores.softmax(-1) @ q64).sum().backward()
    torch.testing.assert_close(relative.bias_table.grad, table.grad.float(), rtol=1e-5,
                               atol=1e-6)


def test_learned_table_limit_is_named():
    learned = LearnedPositions(max_len=6, d_model=8)
    assert learned.embed(torch.arange(6)).shape == (6, 8)
    with pytest.raises(ValueError, match="max_len=6"):
        learned.check_length(7)
    RotaryPositions(head_dim=4).check_length(10_000)
    with pytest.raises(ValueError, match="kind: expected one of"):
        PositionsConfig(kind="absolute")


def test_make_positions_builds_the_configured_scheme():
    sizes = dict(d_model=8, n_head=2, head_dim=4, max_len=6)
    learned = make_positions(PositionsConfig(kind="learned"), **sizes)
    assert isinstance(learned, LearnedPositions) and learned.max_len == 6
    rope = make_positions(PositionsConfig(kind="rope"), **sizes)
    assert isinstance(rope, RotaryPositions) and rope.rotary() is rope.rope
