"""Score modifiers and masks written for FlexAttention run unchanged: a callable sees one
score at a time (0-d index tensors), so ``bias[b][kv_idx]`` and ``table[h][q_idx - kv_idx]``
index one dimension after another. Every engine, against a dense float64 formula written
out by hand, with gradients to the tensors the callables read. (The Triton engine's cases are
in test_triton_engine.py: ``flex_*``.)"""

import pytest
import torch

import qkv
from qkv.engines.cpu import graph_gather, tiles

from .conftest import rand_qkv, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

B, H, HKV, NQ, NK, D, DV = 2, 2, 1, 9, 11, 4, 3


def tensors():
    g = torch.Generator().manual_seed(7)
    bias = torch.randn(B, NK, generator=g, dtype=torch.float64).requires_grad_()
    table = torch.randn(H, NQ + NK - 1, generator=g, dtype=torch.float64).requires_grad_()
    doc = torch.tensor([[0] * 4 + [1] * 7, [0] * 8 + [1] * 3])  # (B, Nk) document ids
    return bias, table, doc


def flex_score_mod(bias, table):
    def score_mod(score, b, h, q_idx, kv_idx):
        return score + bias[b][kv_idx] + table[h][q_idx - kv_idx + NK - 1]

    return score_mod


def flex_mask(doc):
    return qkv.custom_mask(lambda b, h, q_idx, kv_idx: doc[b][q_idx] == doc[b][kv_idx])


def dense_expected(q, k, v, bias, table, doc, allowed_extra=None):
    """softmax(q·k/√D + bias[b, j] + table[h, i - j + Nk - 1]) v over doc[b, i] == doc[b, j]."""
    kk, vv = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
    i = torch.arange(NQ).view(-1, 1)
    j = torch.arange(NK).view(1, -1)
    scores = q @ kk.transpose(-1, -2) / D ** 0.5
    scores = scores + bias.view(B, 1, 1, NK) + table[:, i - j + NK - 1].unsqueeze(0)
    allowed = doc[:, :NQ].view(B, 1, NQ, 1) == doc.view(B, 1, 1, NK)
    if allowed_extra is not None:
        allowed = allowed & allowed_extra
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ vv


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_flex_callables_are_exact_with_gradients(monkeypatch, backend):
    monkeypatch.setattr(tiles, "BLOCK_Q", 4)
    monkeypatch.setattr(tiles, "BLOCK_K", 4)
    q, k, v = rand_qkv(B, H, HKV, NQ, NK, D, DV, requires_grad=True)
    bias, table, doc = tensors()
    out = qkv.attention(q, k, v, mask=flex_mask(doc), score_mod=flex_score_mod(bias, table),
                        backend=backend)
    want = dense_expected(q, k, v, bias, table, doc)
    assert rel_err(out, want) < 1e-12
    inputs = (q, k, v, bias, table)
    grads = torch.autograd.grad(out.square().sum(), inputs)
    want_grads = torch.autograd.grad(want.square().sum(), inputs)
    for g, w in zip(grads, want_grads, strict=True):
        assert rel_err(g, w) < 1e-10


def test_flex_score_mod_on_the_graph_gather_path(monkeypatch):
    """Along graph edges the indices are edge lists, not a grid: still one score at a time."""
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    q, k, v = rand_qkv(B, H, HKV, NQ, NK, D, DV, requires_grad=True)
    bias, table, doc = tensors()
    adjacency = torch.rand(NQ, NK, generator=torch.Generator().manual_seed(3)) > 0.5
    mask = qkv.graph(adjacency)
    out = qkv.attention(q, k, v, mask=mask, score_mod=flex_score_mod(bias, table),
                        backend="graph")
    everything = torch.zeros(B, NK, dtype=torch.long)
    want = dense_expected(q, k, v, bias, table, everything, allowed_extra=adjacency)
    assert rel_err(out, want) < 1e-12
    grads = torch.autograd.grad(out.square().sum(), (q, k, bias, table))
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, bias, table))
    for g, w in zip(grads, want_grads, strict=True):
        assert rel_err(g, w) < 1e-10


def test_flex_mask_classifies_tiles_exactly():
    _, _, doc = tensors()
    mask = flex_mask(doc)
    dense = mask.materialize(B, H, NQ, NK)
    want = doc[:, :NQ].view(B, 1, NQ, 1) == doc.view(B, 1, 1, NK)
    assert torch.equal(dense, want.expand_as(dense))
    states = mask.tile_states(B, H, NQ, NK, 4, 4)
    assert states.shape[-2:] == (3, 3)
