"""Streaming capture into page rows: stored rows and summaries against the full float32 maps,
generation through the KV cache against one uncached forward pass, and the neuron view's
scores against the reference scores for every similarity (with ALiBi on top)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv.core.problem import build_problem
from qkv.core.reference import scores_of
from qkv.core.similarity import SIMILARITIES as SIMILARITY_REGISTRY
from qkv.models import GPT, GPTConfig
from qkv.viz import capture
from qkv.viz.compact import LEVELS, RowsBuilder, compress_head
from qkv.viz.pretrained import greedy_with_rows
from qkv.viz.record import Recorder, neuron_layers_within

SIMILARITIES = ["dot", "cosine", "l2", "l1", "mahalanobis"]


def _gpt(similarity="dot", positions="alibi", seed=0):
    torch.manual_seed(seed)
    block = {"n_head": 4, "n_kv_head": 2, "d_model": 32, "similarity": similarity,
             "dropout": 0.0}
    cfg = GPTConfig(vocab_size=23, block_size=24, n_layer=2, block=block,
                    positions={"kind": positions})
    return GPT(cfg).eval()


def test_compress_head_keeps_weights_above_the_threshold_and_counts_the_rest():
    w = torch.softmax(2 * torch.randn(7, 9, generator=torch.Generator().manual_seed(1)), -1)
    rows = compress_head(w, 0.05, None)
    dense = rows.dense(9)
    kept = torch.where(w >= 0.05, w, 0.0).numpy()
    np.testing.assert_allclose(dense, kept, atol=0.5 / LEVELS)
    np.testing.assert_allclose(rows.dropped, 1 - kept.sum(-1), atol=1e-6)
    capped = compress_head(w, 0.0001, 2)
    assert capped.counts.tolist() == [2] * 7
    top2 = torch.topk(w, 2).indices.sort(-1).values.numpy()
    assert np.array_equal(capped.cols.reshape(7, 2), top2)


def test_summary_by_hand():
    # Row 0 (position 0): all on key 0. Row 1 (position 1): half on key 0, half on key 1.
    w = torch.tensor([[[1.0, 0.0], [0.5, 0.5]]])
    builder = RowsBuilder(1, 0.01, None)
    builder.add(w, 0)
    entropy, distance, sink, previous = builder.summary.means()[0]
    assert entropy == pytest.approx((0 + 1) / 2)  # bits
    assert distance == pytest.approx((0 + 0.5) / 2)
    assert sink == pytest.approx((1 + 0.5) / 2)
    assert previous == pytest.approx(0.5)  # only row 1 has a previous token


def test_streamed_rows_match_the_full_maps():
    model, ids = _gpt(), torch.tensor([[3, 5, 7, 1, 2, 9, 4]])
    recorder = Recorder(0.01, None)
    with capture(model, on_weights=recorder) as maps:
        model(ids)
    assert all(not site.calls for site in maps)  # nothing kept but the compact rows
    with capture(model) as full:
        model(ids)
    view = recorder.view(maps.select(), "gpt", ["t"] * 7, ["t"] * 7)
    for li in range(2):
        for hi in range(4):
            want = full[li][0, hi].numpy()
            np.testing.assert_allclose(view.rows[li][hi].dense(7), np.where(want >= 0.01, want, 0),
                                       atol=0.5 / LEVELS)


def test_generated_rows_equal_one_uncached_pass():
    model = _gpt(positions="rope")
    prompt = [3, 5, 7, 1]
    recorder = Recorder(0.01, None, neuron_layers=[1])
    with capture(model, heads=[0, 3], on_weights=recorder) as maps, torch.no_grad():
        tokens = greedy_with_rows(model, prompt, 5, None)
    assert len(tokens) == 9
    view = recorder.view(maps.select(), "gpt", ["t"] * 9, ["t"] * 9, first_generated=4)
    with capture(model, heads=[0, 3]) as full, torch.no_grad():
        model(torch.tensor([tokens]))
    for li in range(2):
        for hi in range(2):
            want = full[li][0, hi].numpy()
            np.testing.assert_allclose(view.rows[li][hi].dense(9),
                                       np.where(want >= 0.01, want, 0), atol=0.5 / LEVELS + 1e-6)
    neuron = view.neurons[0]
    assert neuron.q_features.shape[:2] == (2, 9) and neuron.k_features.shape[1] == 9


def _record_layer0(model):
    """The recorded page view of layer 0 (neuron data included) for six tokens, and the
    layer's observed call (its q, k, mask and modifier)."""
    ids = torch.tensor([[3, 5, 7, 1, 2, 9]])
    calls = []
    recorder = Recorder(0.01, None, neuron_layers=[0])
    with capture(model, layers=0, on_weights=lambda s, w, call: calls.append(call)), \
            capture(model, layers=0, on_weights=recorder) as maps, torch.no_grad():
        model(ids)
    return recorder.view(maps.select(), "gpt", ["t"] * 6, ["t"] * 6), calls[0]


@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_neuron_scores_are_the_layers_scores(similarity):
    view, call = _record_layer0(_gpt(similarity))
    neuron, m = view.neurons[0], call.module
    p = build_problem(call.q.double(), call.k.double(), call.k.double(), mask=call.mask,
                      score_mod=call.score_mod, similarity=m.similarity,
                      scale=m.scale if not torch.is_tensor(m.scale) else m.scale.double(),
                      metric=None if m.metric is None else m.metric.detach().double())
    reference = scores_of(p, p.q, p.k)[0].numpy()  # (H, N, N)
    kernels = {"dot": lambda a, b: a * b, "neg_sqdist": lambda a, b: -(a - b) ** 2,
               "neg_l1": lambda a, b: -np.abs(a - b)}
    for h in range(4):
        rows = view.rows[0][h]
        q_rows = np.repeat(np.arange(6), rows.counts)
        np.testing.assert_allclose(neuron.scores[h], reference[h, q_rows, rows.cols],
                                   rtol=1e-4, atol=1e-4)
        # What the page draws: the per-dimension terms of the features, summed, times scale.
        terms = kernels[neuron.kernel](neuron.q_features[h][q_rows],
                                       neuron.k_features[neuron.k_of_head[h]][rows.cols])
        np.testing.assert_allclose(neuron.scale[h] * terms.sum(-1), neuron.similarity_scores[h],
                                   rtol=1e-4, atol=1e-4)
    assert neuron.kernel == {"dot": "dot", "cosine": "dot", "l1": "neg_l1"}.get(similarity,
                                                                                 "neg_sqdist")


@pytest.fixture
def user_similarity():
    """A user-defined term, registered for the test only."""
    name = "viz_test_p3"
    SIMILARITY_REGISTRY[name] = qkv.Similarity(lambda q, k: -(q - k).abs() ** 3, name=name)
    yield name
    del SIMILARITY_REGISTRY[name]


def test_neuron_view_of_a_user_similarity_stores_the_layers_scores(user_similarity):
    view, call = _record_layer0(_gpt(user_similarity, positions="rope"))
    neuron = view.neurons[0]
    p = build_problem(call.q.double(), call.k.double(), call.k.double(), mask=call.mask,
                      similarity=user_similarity)
    reference = scores_of(p, p.q, p.k)[0].numpy()
    assert neuron.kernel == "user"  # the page says it cannot draw a user term's parts
    for h in range(4):
        rows = view.rows[0][h]
        q_rows = np.repeat(np.arange(6), rows.counts)
        np.testing.assert_allclose(neuron.scores[h], reference[h, q_rows, rows.cols],
                                   rtol=1e-4, atol=1e-4)


def test_neuron_budget_picks_whole_layers():
    assert neuron_layers_within(8 << 20, list(range(30)), 9, 3, 2048, 64) == [0]
    assert neuron_layers_within(8 << 20, [0, 1], 4, 2, 16, 8) == [0, 1]
    assert neuron_layers_within(8 << 20, [5, 7], 9, 3, 2048, 64) == [5]


@pytest.mark.parametrize("positions", ["alibi", "rope"])
def test_row_blocks_record_what_whole_calls_record(positions):
    """A long call handed over a few query rows at a time (bounded memory) gives the same
    rows, summaries and neuron data as the whole call (ALiBi and the causal mask see the
    rows' own positions)."""
    model, ids = _gpt(positions=positions), torch.tensor([[3, 5, 7, 1, 2, 9, 4, 8, 6]])
    views = []
    for row_bytes in (None, 3 * 4 * 4 * 9):  # whole calls; blocks of 3 rows (4 heads, 9 keys)
        recorder = Recorder(0.01, None, neuron_layers=[1])
        with capture(model, on_weights=recorder, row_bytes=row_bytes) as maps, torch.no_grad():
            model(ids)
        views.append(recorder.view(maps.select(), "gpt", ["t"] * 9, ["t"] * 9))
    whole, blocks = views
    for li in range(2):
        for a, b in zip(whole.rows[li], blocks.rows[li], strict=True):
            np.testing.assert_array_equal(a.dense(9), b.dense(9))
            np.testing.assert_allclose(a.dropped, b.dropped, atol=1e-6)
    np.testing.assert_allclose(whole.summary, blocks.summary, atol=1e-5)
    for a, b in zip(whole.neurons[0].scores, blocks.neurons[0].scores, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
