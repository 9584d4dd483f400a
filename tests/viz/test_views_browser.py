"""Each view of pages ``qkv viz`` writes, opened in headless Chromium and checked against the
weights the page stores and the model's own captured maps: a translate run, a ViT run, and
(tests/viz/test_pretrained_views.py) MiniLM and SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.viz import capture
from qkv.viz.page import read_page

from .driving import check_every_view, open_page, show
from .runs import make_translate_run, make_vit_run


def _assert_stored(stored, view, maps):
    """The page's rows of each layer and head are the captured weights (>= 0.01, to 1/255)."""
    for li, site in enumerate(maps):
        for hi in range(site.weights.shape[1]):
            want = site.weights[0, hi].numpy()
            np.testing.assert_allclose(stored.weights(view, li, hi),
                                       np.where(want >= 0.01, want, 0), atol=0.5 / 255 + 1e-5)


@pytest.fixture(scope="module")
def translate_page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("translate")
    model, src_tok, tgt_tok = make_translate_run(folder / "run")
    page = folder / "t.html"
    assert main(["viz", str(folder / "run"), "--text", "zweiun", "-o", str(page)]) == 0
    stored = read_page(page)
    # Teacher-forced on the translation the page shows (its decoder tokens after <bos>).
    target = [1] + tgt_tok.encode("".join(stored.meta["views"][1]["query_tokens"][1:]))
    with capture(model.eval()) as maps, torch.no_grad():
        model(torch.tensor([src_tok.encode("zweiun")]), torch.tensor([target]))
    for view, (stack, cross) in enumerate([("encoder", False), ("decoder", False),
                                           (None, True)]):
        _assert_stored(stored, view, maps.select(stack=stack, cross=cross))
    return page, stored


@pytest.mark.parametrize("view", [0, 1, 2])
def test_translate_run_every_view(browser, translate_page, view):
    page, stored = translate_page
    check_every_view(browser, page, stored, view)


def test_translate_encoder_rollout_in_the_matrix_view(browser, translate_page):
    page, stored = translate_page
    open_page(browser, page)
    show(browser, "matrix", 0, "rollout", "0")
    origin = browser.find_element("id", "matrix").get_attribute("data-origin")
    assert origin and browser.execute_script("return document.body.dataset.layer") == "rollout"


def test_vit_run_every_view(browser, tmp_path):
    from qkv.train.rundir import load_run
    from qkv.train.tasks.vit import load

    make_vit_run(tmp_path / "run")
    page = tmp_path / "v.html"
    assert main(["viz", str(tmp_path / "run"), "--image", "1", "-o", str(page)]) == 0
    stored = read_page(page)
    run = load_run(tmp_path / "run")
    _, test = load(run.config.data)
    with capture(run.model) as maps, torch.no_grad():
        run.model(torch.from_numpy(test.images[1:2]))
    _assert_stored(stored, 0, maps.select())
    check_every_view(browser, page, stored)
