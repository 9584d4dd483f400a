"""Pictures: the files exist in the asked format and the heatmaps show the given weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv.viz import plots


def _image_data(fig):
    return np.asarray(fig.axes[0].images[0].get_array())


def test_head_heatmap_has_the_weights_and_token_labels(tmp_path):
    weights = torch.softmax(torch.randn(4, 4), -1)
    fig = plots.plot_head(weights, ["the", "cat", "sat", "."], title="layer 0 head 1")
    np.testing.assert_allclose(_image_data(fig), weights.numpy(), rtol=1e-6)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["the", "cat", "sat", "."]
    path = plots.save_figure(fig, tmp_path / "head.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grid_of_heads_and_svg(tmp_path):
    weights = torch.softmax(torch.randn(3, 5, 5), -1)
    fig = plots.plot_heads(weights, list("abcde"), heads=[0, 2, 5])
    titles = [ax.get_title() for ax in fig.axes if ax.images]
    assert titles == ["layer head 0", "layer head 2", "layer head 5"]
    np.testing.assert_allclose(np.asarray(fig.axes[1].images[0].get_array()), weights[1].numpy(),
                               rtol=1e-6)
    text = plots.save_figure(fig, tmp_path / "grid.svg").read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


def test_alignment_and_image_relevance(tmp_path):
    cross = torch.softmax(torch.randn(3, 4), -1)
    fig = plots.plot_alignment(cross, ["zwei", "und", "vier", "zig"], ["forty", "-", "two"])
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["forty", "-", "two"]
    plots.save_figure(fig, tmp_path / "align.png")
    fig = plots.plot_image_relevance(torch.rand(1, 8, 8), torch.rand(2, 2))
    assert plots.save_figure(fig, tmp_path / "vit.png").stat().st_size > 0


def test_bad_input(tmp_path):
    with pytest.raises(ValueError, match="3 labels but the weights have 4"):
        plots.plot_head(torch.rand(4, 4), ["a", "b", "c"])
    with pytest.raises(ValueError, match=r"\(H, Nq, Nk\)"):
        plots.plot_heads(torch.rand(4, 4))
    with pytest.raises(ValueError, match="does not tile"):
        plots.plot_image_relevance(torch.rand(8, 8), torch.rand(3, 3))
    with pytest.raises(ValueError, match=".png or .svg"):
        plots.save_figure(plots.plot_head(torch.rand(2, 2)), tmp_path / "x.jpg")
