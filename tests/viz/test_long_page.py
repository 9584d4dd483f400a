"""A long input's page (``qkv viz`` past ``scene.LONG_INPUT`` tokens, lowered here so that a
small run is long): the per-row summaries of every layer and head, the maps of the chosen
layers and heads only, and what it leaves out, in the file and in Chromium."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.viz import capture, page_rows
from qkv.viz.page import read_page

from .driving import open_page, select
from .runs import make_lm_run

TEXT = "the cat sat at the hut as the rat ran at the cat"  # 48 tokens of the run's characters


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "lm"
    model, tok = make_lm_run(run_dir, ["model.n_layer=3", "model.block.n_head=4",
                                       "model.block.n_kv_head=2", "model.block_size=64"])
    return run_dir, model, tok


@pytest.fixture(scope="module")
def long_page(long_run, tmp_path_factory):
    run_dir, _, _ = long_run
    out = tmp_path_factory.mktemp("page") / "long.html"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qkv.viz.scene.LONG_INPUT", 16)
        assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(out), "--layers", "0,2",
                     "--heads", "1"]) == 0
    return out


def _expected(weights: torch.Tensor) -> dict[str, np.ndarray]:
    """Per-row summaries of (Nq, Nk) causal weights, in float64."""
    w = weights.double()
    n = w.shape[0]
    gap = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().double()
    previous = torch.cat([torch.zeros(1, dtype=w.dtype), w.diagonal(-1)])
    return {"entropy": -(w * torch.log(w.clamp_min(1e-300))).sum(-1) / math.log(2),
            "distance": (w * gap).sum(-1), "sink": w[:, 0], "previous": previous,
            "received": w.sum(0)}


def test_the_page_holds_every_heads_summaries_and_the_chosen_maps(long_run, long_page):
    _, model, tok = long_run
    stored = read_page(long_page)
    view = stored.meta["views"][0]
    assert view["layers"] == [0, 1, 2] and view["heads"] == [0, 1, 2, 3]
    mapped = {(li, hi) for li in range(3) for hi in range(4) if view["maps"][li][hi]}
    assert mapped == {(0, 1), (2, 1)}
    assert "maps of layers 0, 2 x heads 1 (2 of 12 heads)" in view["omitted"][0]
    assert view["omitted"][1].startswith("Left out: the maps of the other 10 heads")
    with capture(model) as maps, torch.no_grad():
        model(torch.tensor([tok.encode(TEXT)]))
    scales = stored.meta["views"][0]["row_stats"]["scales"]
    for li in range(3):
        for hi in range(4):
            weights = maps[li][0, hi]
            expected = _expected(weights)
            for name, ref in view["row_stats"]["layers"][li][hi].items():
                codes = page_rows.encode(expected[name].numpy(), *scales[name])
                got = stored.array(ref).astype(int)
                assert np.abs(got - codes).max() <= 1, (li, hi, name)
            means = [expected[name].mean() for name in ("entropy", "distance", "sink")]
            means.append(expected["previous"][1:].mean())
            np.testing.assert_allclose(view["summary"][li][hi], means, atol=2e-4)
            if (li, hi) in mapped:  # the map: weights of at least the threshold, to 1/255
                want = np.where(weights.numpy() >= 0.01, weights.numpy(), 0.0)
                np.testing.assert_allclose(stored.weights(0, li, hi), want, atol=0.5 / 255 + 1e-6)


def test_without_layers_or_heads_the_last_layer_is_mapped(long_run, tmp_path, monkeypatch):
    run_dir, _, _ = long_run
    monkeypatch.setattr("qkv.viz.scene.LONG_INPUT", 16)
    out = tmp_path / "default.html"
    assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(out)]) == 0
    view = read_page(out).meta["views"][0]
    assert [[m is not None for m in layer] for layer in view["maps"]] == \
        [[False] * 4, [False] * 4, [True] * 4]
    assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(out), "--layers", "3"]) == 2


def test_summaries_without_maps_in_the_browser(browser, long_page):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    stored = read_page(long_page)
    open_page(browser, long_page)
    # A long input's page opens on the per-row summaries of layer 0, head 0 (no map).
    assert browser.execute_script("return document.body.dataset.display") == "rows"
    canvases = browser.find_elements(By.CSS_SELECTOR, "canvas.series")
    assert [c.get_attribute("data-series") for c in canvases] == \
        ["entropy", "distance", "sink", "previous", "received"]
    series = stored.row_stats(0, 0, 0)
    for canvas in canvases:
        name = canvas.get_attribute("data-series")
        assert int(canvas.get_attribute("data-count")) == len(series[name])
        assert float(canvas.get_attribute("data-mean")) == pytest.approx(series[name].mean(),
                                                                          abs=1e-5)
    entropy = canvases[0]
    width = entropy.size["width"]
    ActionChains(browser).move_to_element_with_offset(entropy, 0, 0).perform()  # the centre
    readout = browser.find_element(By.ID, "row-readout")
    q = int(readout.get_attribute("data-index"))
    assert abs(q - len(series["entropy"]) // 2) <= len(series["entropy"]) / width + 1
    assert f"entropy {series['entropy'][q]:.2f} bits" in readout.text
    assert f"first token {series['sink'][q]:.3f}" in readout.text
    # The matrix view of a head without a map says so; a mapped head draws its map.
    select(browser, "display", "matrix")
    assert "holds this head's per-row summaries" in browser.find_element(By.ID, "no-map").text
    assert "Left out: the maps of the other 10 heads" in \
        browser.find_element(By.ID, "omitted").text
    select(browser, "layer", "2")
    select(browser, "head", "1")
    assert browser.find_elements(By.ID, "matrix") and not browser.find_elements(By.ID, "no-map")
    select(browser, "display", "model")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#model-grid canvas.no-map")) == 10
    select(browser, "display", "summary")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#summary tbody tr")) == 12


@pytest.fixture(scope="module")
def sigmoid_page(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "sigmoid"
    make_lm_run(run_dir, ["model.n_layer=2", "model.block.n_head=2", "model.block_size=64",
                          "model.block.weighting=sigmoid"])
    out = tmp_path_factory.mktemp("page") / "sigmoid.html"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qkv.viz.scene.LONG_INPUT", 16)
        assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(out)]) == 0
    return out


def test_rows_that_do_not_sum_to_one_show_their_mass(sigmoid_page, long_page):
    """A sigmoid model's page holds each row's mass (its weights' sum); a softmax model's,
    whose rows all sum to 1, does not."""
    assert "mass" not in read_page(long_page).meta["views"][0]["row_stats"]["scales"]
    stored = read_page(sigmoid_page)
    view = stored.meta["views"][0]
    scale = view["row_stats"]["scales"]["mass"]
    mass = stored.row_stats(0, 1, 0)["mass"]
    assert scale[0] == "log" and 0 < mass.max() <= scale[1] + 1e-6
    assert not np.allclose(mass, 1.0, atol=0.05)


def test_the_row_mass_in_the_browser(browser, sigmoid_page):
    from selenium.webdriver.common.by import By

    open_page(browser, sigmoid_page)
    canvases = browser.find_elements(By.CSS_SELECTOR, "canvas.series")
    assert [c.get_attribute("data-series") for c in canvases] == \
        ["entropy", "distance", "sink", "previous", "received", "mass"]
    mass = read_page(sigmoid_page).row_stats(0, 0, 0)["mass"]
    assert float(canvases[-1].get_attribute("data-mean")) == pytest.approx(mass.mean(),
                                                                            abs=1e-5)
