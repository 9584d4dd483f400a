"""Attention rollout against a two-layer case worked by hand."""

from __future__ import annotations

import pytest
import torch

from qkv.viz import attention_rollout, patch_relevance


def test_two_layers_by_hand():
    # Layer 1: two heads whose mean is A1 = [[1, 0], [.5, .5]];
    #   Â1 = .5·A1 + .5·I = [[1, 0], [.25, .75]] (rows already sum to 1).
    # Layer 2: A2 = [[0, 1], [0, 1]];  Â2 = [[.5, .5], [0, 1]].
    # Rollout Â2·Â1 = [[.5 + .125, .375], [.25, .75]].
    layer1 = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]]]])
    layer2 = torch.tensor([[[[0.0, 1.0], [0.0, 1.0]]]])
    got = attention_rollout([layer1, layer2])
    torch.testing.assert_close(got, torch.tensor([[[0.625, 0.375], [0.25, 0.75]]]))


def test_rows_are_renormalized_when_a_query_attends_to_nothing():
    # A masked query row is all zero: Â row = [.5, 0] -> renormalized to [1, 0].
    layer = torch.tensor([[[[0.0, 0.0], [0.5, 0.5]]]])
    got = attention_rollout([layer])
    torch.testing.assert_close(got, torch.tensor([[[1.0, 0.0], [0.25, 0.75]]]))


def test_head_fusion_and_residual_weight():
    heads = torch.tensor([[[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]]])
    no_residual = attention_rollout([heads], residual=0.0, head_fusion="max")
    # max over heads = all ones; renormalized rows = [.5, .5].
    torch.testing.assert_close(no_residual, torch.full((1, 2, 2), 0.5))
    assert torch.equal(attention_rollout([heads], residual=1.0), torch.eye(2).unsqueeze(0))


def test_rollout_rows_stay_stochastic_on_random_maps():
    layers = [torch.softmax(torch.randn(3, 4, 6, 6), -1) for _ in range(3)]
    rows = attention_rollout(layers).sum(-1)
    torch.testing.assert_close(rows, torch.ones(3, 6))


def test_patch_relevance_reads_the_class_token_row():
    rollout = torch.zeros(1, 5, 5)
    rollout[0, 0] = torch.tensor([0.2, 0.1, 0.4, 0.2, 0.1])
    got = patch_relevance(rollout, (2, 2), cls_token=True)
    torch.testing.assert_close(got, torch.tensor([[[0.25, 1.0], [0.5, 0.25]]]))


def test_bad_input():
    with pytest.raises(ValueError, match="at least one layer"):
        attention_rollout([])
    with pytest.raises(ValueError, match=r"\(B, H, N, N\)"):
        attention_rollout([torch.rand(1, 2, 3, 4)])
    with pytest.raises(ValueError, match="share B and N"):
        attention_rollout([torch.rand(1, 2, 3, 3), torch.rand(1, 2, 4, 4)])
    with pytest.raises(ValueError, match="residual"):
        attention_rollout([torch.rand(1, 1, 2, 2)], residual=1.5)
    with pytest.raises(ValueError, match="head_fusion"):
        attention_rollout([torch.rand(1, 1, 2, 2)], head_fusion="median")
    with pytest.raises(ValueError, match="N=5"):
        patch_relevance(torch.rand(1, 4, 4), (2, 2), cls_token=True)
