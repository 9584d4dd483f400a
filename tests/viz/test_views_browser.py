"""Each view of pages ``qkv viz`` writes, opened in headless Chromium and checked against the
weights the page stores and the model's own captured maps: a translate run, a ViT run, and
(tests/viz/test_pretrained_views.py) MiniLM and SmolLM2."""

from __future__ import annotations

import numpy as np
import pytest

from qkv.cli import main
from qkv.viz.page import read_page

from .driving import check_every_view, open_page, show
from .runs import make_translate_run, make_vit_run


@pytest.fixture(scope="module")
def translate_page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("translate")
    make_translate_run(folder / "run")
    page = folder / "t.html"
    assert main(["viz", str(folder / "run"), "--text", "zweiun", "-o", str(page)]) == 0
    return page, read_page(page)


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
    make_vit_run(tmp_path / "run")
    page = tmp_path / "v.html"
    assert main(["viz", str(tmp_path / "run"), "--image", "1", "-o", str(page)]) == 0
    stored = read_page(page)
    check_every_view(browser, page, stored)
    rows = stored.weights(0, 0, 0)
    assert np.all(rows.sum(-1) <= 1 + 1e-6)
