"""Block tables and block layouts of the Triton engine (torch only: no Triton needed)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import qkv
from qkv.core.kept import Kept
from qkv.core.masks import EMPTY, FULL, PARTIAL, states_from
from qkv.engines.triton import blocks
from qkv.engines.triton.blocks import (
    block_layout,
    classify,
    coarsen,
    column_table,
    row_table,
)

from .test_triton_engine import _edges


@pytest.mark.parametrize(
    "mask",
    [qkv.causal(), qkv.sliding_window(20, 3), qkv.segments(torch.arange(100) // 30),
     qkv.graph(_edges(100, 100), num_nodes=100),
     qkv.custom_mask(lambda b, h, q, kv: (q + kv) % 7 < 3)],
    ids=["causal", "sliding", "segments", "graph", "custom"],
)
def test_coarsened_tile_states_equal_direct_classification(mask):
    fine = classify(mask, 1, 1, 100, 100, 16, 16, "cpu")
    direct = classify(mask, 1, 1, 100, 100, 32, 64, "cpu")
    assert torch.equal(coarsen(fine, 2, 4), direct)


def test_block_tables_list_partial_then_full_and_never_empty():
    states = torch.tensor([[[[FULL, EMPTY, PARTIAL, FULL], [EMPTY, EMPTY, EMPTY, PARTIAL]]]],
                          dtype=torch.uint8)
    rows, cols = row_table(states, nk=64, block_n=16), column_table(states, nk=64, block_n=16)
    assert rows[0, 0, 0].tolist()[:5] == [1, 2, 2, 0, 3]
    assert rows[0, 0, 1].tolist()[:3] == [1, 0, 3]
    assert cols[0, 0, 3].tolist()[:4] == [1, 1, 1, 0]
    ragged = row_table(states, nk=60, block_n=16)  # last key tile padded: never FULL
    assert ragged[0, 0, 0].tolist()[:5] == [2, 1, 2, 3, 0]


def test_states_from_marks_full_over_empty_and_keeps_uint8():
    full = torch.tensor([[True, False, False]])
    empty = torch.tensor([[False, True, False]])
    states = states_from(full, empty)
    assert states.dtype == torch.uint8
    assert states.tolist() == [[FULL, EMPTY, PARTIAL]]


def _layout(mask, nq=100, nk=100):
    return block_layout(mask, 2, 3, nq, nk, 16, 16, "cpu")


@pytest.mark.parametrize(
    "make",
    [lambda: None, qkv.causal, lambda: qkv.sliding_window(20, 3),
     lambda: qkv.causal() & ~qkv.sliding_window(5),
     lambda: qkv.causal() | qkv.sliding_window(4, 4)],
    ids=["none", "causal", "sliding", "and_not", "or"],
)
def test_a_mask_without_tensors_keeps_its_layout_between_calls(make):
    first, again = _layout(make()), _layout(make())  # equal masks, new objects
    assert again is first
    assert _layout(make(), nq=90) is not first
    table = first.table(32, 32)
    assert first.table(32, 32) is table
    expected = row_table(coarsen(classify(make(), 2, 3, 100, 100, 16, 16, "cpu"), 2, 2), 100, 32)
    assert torch.equal(table, expected)


def test_a_layout_follows_a_changed_window():
    mask = qkv.sliding_window(20)
    before = _layout(mask)
    mask.left = 60
    after = _layout(mask)
    assert after is not before
    assert torch.equal(after.fine, classify(qkv.sliding_window(60), 2, 3, 100, 100, 16, 16, "cpu"))


def test_a_mask_reading_user_code_is_classified_every_call():
    mask = qkv.custom_mask(lambda b, h, q, kv: kv <= q)
    assert mask.layout_key() is None
    assert _layout(mask) is not _layout(mask)


@pytest.mark.parametrize(
    ("make", "values"),
    [(lambda t: qkv.segments(t), torch.arange(100) // 30),
     (lambda t: qkv.causal() & qkv.segments(t), torch.arange(100) // 30),
     (lambda t: qkv.padding(t), torch.tensor([70, 100]))],
    ids=["segments", "causal_and_segments", "padding"],
)
def test_a_mask_over_an_unchanged_tensor_keeps_its_layout_until_the_tensor_changes(make, values):
    first = _layout(make(values))
    assert _layout(make(values)) is first  # a new mask object over the same tensor
    assert _layout(make(values.clone())) is not first  # equal values elsewhere: made anew
    values[-1:] -= 20  # in place: the version moves, the layout is made again
    after = _layout(make(values))
    assert after is not first and not torch.equal(after.fine, first.fine)
    assert torch.equal(after.fine, classify(make(values), 2, 3, 100, 100, 16, 16, "cpu"))


def test_a_kept_layout_does_not_keep_the_mask_s_tensor_alive():
    ids = torch.arange(100) // 30
    gone = weakref.ref(ids)
    _layout(qkv.segments(ids))
    del ids
    gc.collect()
    assert gone() is None


def test_tensors_that_keep_no_version_are_not_keyed():
    with torch.inference_mode():
        ids = torch.arange(100) // 30
    assert qkv.segments(ids).layout_key() is None
    assert qkv.segments(torch.arange(100, device="meta")).layout_key() is None


def test_a_layout_key_is_equal_over_the_same_unchanged_tensor_only():
    ids = torch.arange(100) // 30
    key = qkv.segments(ids).layout_key()
    assert qkv.segments(ids).layout_key() == key  # a new mask over the same tensor
    assert hash(qkv.segments(ids).layout_key()) == hash(key)
    assert qkv.segments(ids.clone()).layout_key() != key  # equal values, other memory
    assert qkv.padding(ids).layout_key() != key  # another rule over the same tensor
    assert (qkv.causal() & qkv.segments(ids)).layout_key() == (
        qkv.causal() & qkv.segments(ids)).layout_key()
    ids[0] = 0  # an in-place write, even of the value it held, moves the version
    assert qkv.segments(ids).layout_key() != key


def test_only_the_last_layouts_are_kept(monkeypatch):
    monkeypatch.setattr(blocks, "_layouts", Kept(3))
    first = [_layout(qkv.causal(), nq=n) for n in (10, 20, 30)]
    assert _layout(qkv.causal(), nq=10) is first[0]  # now the most recent
    _layout(qkv.causal(), nq=40)  # evicts nq=20, the least recent
    assert len(blocks._layouts) == 3
    assert _layout(qkv.causal(), nq=10) is first[0]
    assert _layout(qkv.causal(), nq=20) is not first[1]


def test_no_layout_is_kept_or_reused_while_a_cuda_graph_is_captured(monkeypatch):
    kept = _layout(qkv.causal(), nq=70)
    monkeypatch.setattr(blocks, "_capturing", lambda device: True)
    during = _layout(qkv.causal(), nq=70)
    assert during is not kept and torch.equal(during.fine, kept.fine)
    assert _layout(qkv.causal(), nq=71) is not _layout(qkv.causal(), nq=71)
    monkeypatch.setattr(blocks, "_capturing", lambda device: False)
    assert _layout(qkv.causal(), nq=70) is kept


def test_capture_is_only_asked_of_cuda_devices():
    assert not blocks._capturing(torch.device("cpu"))
