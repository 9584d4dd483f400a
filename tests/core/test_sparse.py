"""Sparse patterns: each equals its dense definition, classifies tiles exactly, composes with
the other masks, and runs through qkv.attention like the reference on the dense bool mask."""

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.core.masks import EMPTY, FULL, Mask
from qkv.core.problem import build_problem
from qkv.core.sparse import (
    block_sparse,
    dilated_window,
    fixed,
    global_local,
    global_tokens,
    random_block_layout,
    strided,
)


def dense(nq, nk, rule):
    """The bool (Nq, Nk) matrix of rule(p, j), p = i + Nk - Nq, written as a plain loop."""
    out = torch.zeros(nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            out[i, j] = bool(rule(i + nk - nq, j))
    return out


LAYOUT = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 0], [1, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.bool)
RANDOM = random_block_layout(4, 2, seed=3)

PATTERNS = {
    "strided": (strided(3), lambda p, j: (p - j) % 3 == 0),
    "strided_causal": (strided(4) & qkv.causal(), lambda p, j: (p - j) % 4 == 0 and j <= p),
    "dilated": (dilated_window(2, 3, 1), lambda p, j: j in {p - 3 * t for t in range(-1, 3)}),
    "fixed": (fixed(4, 1), lambda p, j: p // 4 == j // 4 or j % 4 == 3),
    "fixed_causal": (fixed(5, 2) & qkv.causal(),
                     lambda p, j: (p // 5 == j // 5 or j % 5 >= 3) and j <= p),
    "global": (global_tokens([0, 5]), lambda p, j: p in (0, 5) or j in (0, 5)),
    "longformer": (global_local(2, 1), lambda p, j: abs(p - j) <= 2 or p == 0 or j == 0),
    "bigbird": (
        global_local(1, [3], random_blocks=2, block_size=4, max_len=16, seed=3),
        lambda p, j: abs(p - j) <= 1 or 3 in (p, j) or (p >= 0 and bool(RANDOM[p // 4, j // 4])),
    ),
    "block_sparse": (block_sparse(LAYOUT, 4), lambda p, j: p >= 0 and bool(LAYOUT[p // 4, j // 4])),
    "block_sparse_or_causal": (
        block_sparse(LAYOUT, 4) | qkv.sliding_window(1),
        lambda p, j: (p >= 0 and bool(LAYOUT[p // 4, j // 4])) or p - 1 <= j <= p,
    ),
}


@pytest.mark.parametrize("name", sorted(PATTERNS))
@pytest.mark.parametrize("shape", [(16, 16), (5, 16), (16, 13)])
def test_pattern_equals_dense_definition(name, shape):
    mask, rule = PATTERNS[name]
    nq, nk = shape
    got = mask.materialize(1, 1, nq, nk)[0, 0]
    assert torch.equal(got, dense(nq, nk, rule))


def exact_states(mask, nq, nk, bq, bk):
    """The tile states computed from mask_mod entry by entry (the generic base method)."""
    return Mask.tile_states(mask, 1, 1, nq, nk, bq, bk)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["strided", "dilated", "fixed", "global", "block"]),
    a=st.integers(1, 5), c=st.integers(0, 3), nq=st.integers(1, 24), nk=st.integers(1, 24),
    bq=st.integers(1, 7), bk=st.integers(1, 7),
)
def test_tile_states_are_exact(kind, a, c, nq, nk, bq, bk):
    if kind == "strided":
        mask = strided(a)
    elif kind == "dilated":
        mask = dilated_window(c, a, right=c % 2)
    elif kind == "fixed":
        mask = fixed(a + c, min(c, a))
    elif kind == "global":
        mask = global_tokens([a, a + c, 2 * a + 7])
    else:
        layout = torch.rand(8, 8, generator=torch.Generator().manual_seed(a * 10 + c)) > 0.5
        mask = block_sparse(layout, 3 + c % 2)
    fast = mask.tile_states(1, 1, nq, nk, bq, bk)
    assert torch.equal(fast, exact_states(mask, nq, nk, bq, bk))


def test_union_tile_states_are_safe():
    """For unions, EMPTY is exact and FULL is claimed only where it holds."""
    mask, _ = PATTERNS["bigbird"]
    for bq, bk in ((2, 3), (4, 4), (5, 8)):
        fast = mask.tile_states(1, 1, 16, 16, bq, bk)
        exact = exact_states(mask, 16, 16, bq, bk)
        assert torch.equal(fast == EMPTY, exact == EMPTY)
        assert not ((fast == FULL) & (exact != FULL)).any()


def test_tiles_far_from_the_window_are_skipped():
    mask = global_local(64, 1)
    states = mask.tile_states(1, 1, 2048, 2048, 64, 128)
    assert torch.equal(states == EMPTY, exact_states(mask, 2048, 2048, 64, 128) == EMPTY)
    assert (states != EMPTY).float().mean().item() < 0.3


@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_attention_with_pattern_equals_reference_on_dense_mask(name):
    mask, _ = PATTERNS[name]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 4, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = qkv.attention(q, k, v, mask=mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = qkv.attention(q, k, v, mask=mask.materialize(2, 2, 16, 16), backend="reference")
    ref_grads = torch.autograd.grad(ref.sum(), (q, k, v))
    assert (out - ref).abs().max().item() < 1e-12
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a - b).abs().max().item() < 1e-12


@pytest.mark.parametrize("mask", [
    global_local(16, [0, 300], random_blocks=1, block_size=128, max_len=640) & qkv.causal(),
    dilated_window(40, 3) | strided(200),
    fixed(128, 16) & qkv.causal(),
], ids=["bigbird_causal", "dilated_or_strided", "fixed_causal"])
def test_multi_tile_engine_run_equals_reference(mask):
    """Long enough for the fused engine to skip and mask several tiles."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 640, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    out = qkv.attention(q, k, v, mask=mask)
    ref = qkv.attention(q, k, v, mask=mask.materialize(1, 2, 640, 640), backend="reference")
    assert (out - ref).abs().max().item() < 1e-12
    grads = torch.autograd.grad(out.pow(2).sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.pow(2).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        assert (a - b).abs().max().item() < 1e-11


def test_per_head_layout():
    layout = torch.stack([LAYOUT, ~LAYOUT])
    mask = block_sparse(layout, 4)
    m = mask.materialize(1, 2, 16, 16)
    assert torch.equal(m[0, 1], ~m[0, 0])
    states = mask.tile_states(1, 2, 16, 16, 4, 4)
    assert torch.equal(states, Mask.tile_states(mask, 1, 2, 16, 16, 4, 4))


def test_random_layout_has_the_asked_blocks_per_row():
    layout = random_block_layout(10, 3, seed=1)
    assert layout.sum(1).tolist() == [3] * 10
    assert torch.equal(layout, random_block_layout(10, 3, seed=1))


def test_bad_inputs():
    with pytest.raises(ValueError, match="stride must be an int >= 1"):
        strided(0)
    with pytest.raises(ValueError, match="dilation must be an int >= 1"):
        dilated_window(2, 0)
    with pytest.raises(ValueError, match="summary must be <= block"):
        fixed(4, 5)
    with pytest.raises(ValueError, match="layout must be a bool tensor"):
        block_sparse(torch.ones(2, 2), 4)
    with pytest.raises(ValueError, match="the layout covers 16 positions"):
        block_sparse(LAYOUT, 4).materialize(1, 1, 20, 20)
    with pytest.raises(ValueError, match="random_blocks needs max_len"):
        global_local(2, 1, random_blocks=2)
    with pytest.raises(ValueError, match="positions must be >= 0"):
        global_tokens([-1])
    q = torch.zeros(1, 1, 20, 4)
    with pytest.raises(ValueError, match="the layout covers"):
        qkv.attention(q, q, q, mask=PATTERNS["bigbird"][0])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_patterns_compile_for_the_triton_engine(name):
    """Every rule is plain index arithmetic the Triton tracer compiles (no kernel launch)."""
    from qkv.engines.triton import unsupported

    q = torch.zeros(1, 2, 16, 16)
    problem = build_problem(q, q, q, mask=PATTERNS[name][0], score_mod=None, similarity="dot",
                            scale=None, metric=None, dropout_p=0.0, return_weights=False)
    assert unsupported(problem) is None
