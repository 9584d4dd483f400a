"""Mask semantics, combinations, and tile classification against materialized masks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv
from qkv.core.masks import EMPTY, FULL, as_mask

from .conftest import mask_cases


def dense(mask, b=1, h=1, nq=6, nk=6):
    return mask.materialize(b, h, nq, nk)[0, 0]


def test_causal_bottom_right():
    assert torch.equal(dense(qkv.causal(), nq=3, nk=5), torch.ones(3, 5, dtype=torch.bool).tril(2))
    # Nq > Nk: the first queries see nothing.
    assert torch.equal(dense(qkv.causal(), nq=5, nk=3), torch.ones(5, 3, dtype=torch.bool).tril(-2))


def test_sliding_window():
    expected = torch.ones(6, 6, dtype=torch.bool).tril(1).triu(-2)
    assert torch.equal(dense(qkv.sliding_window(2, 1)), expected)
    assert torch.equal(dense(qkv.sliding_window(0)), torch.eye(6, dtype=torch.bool))


def test_padding_and_segments():
    m = qkv.padding(torch.tensor([2, 4])).materialize(2, 1, 3, 5)
    assert m[0, 0].sum(-1).tolist() == [2, 2, 2] and m[1, 0].sum(-1).tolist() == [4, 4, 4]
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    assert torch.equal(dense(qkv.segments(ids)), ids[:, None] == ids[None, :])
    kv_ids = torch.tensor([1, 1, 2])
    m = qkv.segments(ids, kv_ids).materialize(1, 1, 6, 3)[0, 0]
    assert torch.equal(m, ids[:, None] == kv_ids[None, :])


def test_graph_edges_and_adjacency_agree():
    edges = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 0]])  # (source, target); a duplicate edge
    adjacency = torch.zeros(3, 3, dtype=torch.bool)
    adjacency[1, 0] = adjacency[2, 1] = adjacency[0, 2] = True  # target attends to source
    assert torch.equal(dense(qkv.graph(edges), nq=3, nk=3), adjacency)
    assert torch.equal(dense(qkv.graph(adjacency), nq=3, nk=3), adjacency)
    assert qkv.graph(edges).num_edges == 3


def test_combinators():
    a, b = qkv.causal(), qkv.sliding_window(1, 1)
    assert torch.equal(dense(a & b), dense(a) & dense(b))
    assert torch.equal(dense(a | b), dense(a) | dense(b))
    assert torch.equal(dense(~a), ~dense(a))
    t = torch.rand(6, 6) > 0.5
    assert torch.equal(dense(a & t), dense(a) & t)
    assert torch.equal(dense(t | a), dense(a) | t)


def test_custom_mask():
    m = qkv.custom_mask(lambda b, h, q, k: (q + k) % 2 == 0)
    i = torch.arange(6)
    assert torch.equal(dense(m), (i[:, None] + i[None, :]) % 2 == 0)


def check_tile_states(mask, b, h, nq, nk, bq, bk):
    allowed = mask.materialize(b, h, nq, nk).expand(b, h, nq, nk)
    states = mask.tile_states(b, h, nq, nk, bq, bk).expand(b, h, -1, -1)
    assert states.shape[-2:] == (-(-nq // bq), -(-nk // bk))
    for qi in range(states.shape[2]):
        for ki in range(states.shape[3]):
            tile = allowed[:, :, qi * bq : (qi + 1) * bq, ki * bk : (ki + 1) * bk]
            s = states[:, :, qi, ki]
            assert not tile[s == EMPTY].any(), (mask, qi, ki)
            assert tile[s == FULL].all(), (mask, qi, ki)


@pytest.mark.parametrize("name", list(mask_cases(3, 7, 9)))
@pytest.mark.parametrize("blocks", [(2, 3), (4, 4), (8, 16)])
def test_tile_states_are_exact_where_they_claim(name, blocks):
    mask = mask_cases(3, 7, 9)[name]
    mask = qkv.causal() | ~qkv.causal() if mask is None else as_mask(mask)
    check_tile_states(mask, 3, 2, 7, 9, *blocks)


def test_tile_states_find_empty_and_full_tiles():
    s = qkv.causal().tile_states(1, 1, 8, 8, 2, 2)[0, 0]
    assert (s.diagonal() == 1).all() and (s.tril(-1)[s.tril(-1) > 0] == FULL).all()
    assert (s.triu(1) == EMPTY).all()
    s = qkv.segments(torch.tensor([0] * 4 + [1] * 4)).tile_states(1, 1, 8, 8, 4, 4)[0, 0]
    assert s.tolist() == [[FULL, EMPTY], [EMPTY, FULL]]


@settings(max_examples=40, deadline=None)
@given(
    nq=st.integers(1, 12),
    nk=st.integers(1, 12),
    bq=st.integers(1, 5),
    bk=st.integers(1, 5),
    left=st.integers(0, 6),
    right=st.integers(0, 3),
    seed=st.integers(0, 1000),
)
def test_tile_states_property(nq, nk, bq, bk, left, right, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, nk + 1, (2,), generator=g)
    ids = torch.sort(torch.randint(0, 3, (2, nq), generator=g)).values
    kv_ids = torch.sort(torch.randint(0, 3, (2, nk), generator=g)).values
    masks = [
        qkv.sliding_window(left, right) | qkv.padding(lengths),
        qkv.causal() & qkv.segments(ids, kv_ids),
        qkv.graph(torch.rand(nq, nk, generator=g) > 0.7) | qkv.causal(),
        qkv.custom_mask(lambda b, h, q, k: (q * 3 + k) % 4 != 0) & ~qkv.causal(),
    ]
    for mask in masks:
        check_tile_states(mask, 2, 1, nq, nk, bq, bk)


def test_mask_cases_cover_every_mask_kind():
    """The engine x mask matrices iterate ``mask_cases``: a mask class that
    ``qkv.core.masks`` exports without a case there fails here, so it cannot go untested."""
    from qkv.core import masks

    from .conftest import mask_cases, mask_kinds

    defined = {cls for cls in vars(masks).values()
               if isinstance(cls, type) and issubclass(cls, masks.Mask) and cls is not masks.Mask}
    covered = set()
    for mask in mask_cases(2, 5, 7).values():
        if mask is not None:
            covered |= mask_kinds(masks.as_mask(mask))
    assert defined <= covered, f"no case for {sorted(c.__name__ for c in defined - covered)}"
