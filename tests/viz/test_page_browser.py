"""The interactive page in a real headless Chromium: pick a head, hover a token, graph view,
cross-attention and the ViT's patches; the weights drawn are read back from the DOM."""

from __future__ import annotations

import json

import pytest
import torch

from qkv.viz import PageImage, PageView, write_page

from .driving import READ_EDGES, STORED, hover, open_page, select

THRESHOLD = 0.01
TOKENS = ["The", "cat", "sat", "on", "the", "mat"]


def test_missing_browser_skips_locally_and_fails_in_ci():
    from .conftest import unavailable

    assert unavailable(None, "true") is None
    action, message = unavailable("/usr/bin/chromium is missing", None)
    assert action == "skip" and "apt-get install chromium chromium-driver" in message
    assert unavailable("/usr/bin/chromium is missing", "true")[0] == "fail"


def _weights(layers, heads, nq, nk, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(layers, heads, nq, nk, generator=g), -1)


def _kept(w) -> float:
    """What the page holds of one weight: it leaves out those below the threshold."""
    return float(w) if float(w) >= THRESHOLD else 0.0


def _expected(matrix, head):
    """{(q, k): (head, weight)} for every weight the page draws: those at or above the
    threshold."""
    return {(q, k): (str(head), w) for q, row in enumerate(matrix.tolist())
            for k, w in enumerate(row) if w >= THRESHOLD}


def _drawn(driver):
    return {(q, k): (head, w) for q, k, head, w, _ in driver.execute_script(READ_EDGES)}


def _assert_drawn(driver, matrix, head):
    drawn, want = _drawn(driver), _expected(matrix, head)
    assert drawn.keys() == want.keys()
    for key, (h, w) in want.items():
        assert drawn[key][0] == h
        assert abs(drawn[key][1] - w) <= STORED, (key, drawn[key], w)


@pytest.fixture(scope="module")
def seq2seq_page(tmp_path_factory):
    src, tgt = ["zwei", "und", "vier", "zig"], ["forty", "-", "two", "</s>"]
    views = [
        PageView("encoder self-attention", "self", src, src, [0, 1], [0, 1, 2],
                 _weights(2, 3, 4, 4, 1)),
        PageView("decoder self-attention", "self", tgt, tgt, [0, 1], [0, 1, 2],
                 _weights(2, 3, 4, 4, 2).tril()),
        PageView("decoder cross-attention", "cross", tgt, src, [0, 1], [0, 1, 2],
                 _weights(2, 3, 4, 4, 3)),
    ]
    path = write_page(tmp_path_factory.mktemp("page") / "seq2seq.html", views, mode="seq2seq")
    return path, views


def test_pick_a_head_hover_a_token_and_screenshot(browser, tmp_path):
    from selenium.webdriver.common.by import By

    weights = _weights(2, 3, len(TOKENS), len(TOKENS), 0)
    view = PageView("GPT self-attention", "self", TOKENS, TOKENS, [0, 1], [0, 1, 2], weights)
    path = write_page(tmp_path / "gpt.html", [view], mode="gpt", threshold=THRESHOLD)
    open_page(browser, path)
    _assert_drawn(browser, weights[0, 0], 0)

    select(browser, "head", "2")
    _assert_drawn(browser, weights[0, 2], 2)
    select(browser, "layer", "1")
    _assert_drawn(browser, weights[1, 2], 2)

    hover(browser, '.token[data-side="q"][data-index="1"]')
    edges = browser.execute_script(READ_EDGES)
    for q, k, _, _, classes in edges:
        want = "out" if q == 1 else "in" if k == 1 else "dim"
        assert want in classes.split(), (q, k, classes)
    attended = {int(t.get_attribute("data-index")) for t in browser.find_elements(
        By.CSS_SELECTOR, '.token.attended[data-side="k"]')}
    assert attended == {k for q, k, *_ in edges if q == 1}
    assert browser.find_element(By.ID, "info").text.startswith('"cat" attends to:')
    shot = tmp_path / "gpt-hover.png"
    assert browser.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")

    select(browser, "head", "all")
    heads = {head for _, _, head, _, _ in browser.execute_script(READ_EDGES)}
    assert heads == {"0", "1", "2"}


def test_graph_view_draws_the_layer_as_directed_edges(browser, seq2seq_page, tmp_path):
    path, views = seq2seq_page
    open_page(browser, path)
    select(browser, "display", "graph")
    select(browser, "head", "1")
    _assert_drawn(browser, views[0].weights[0, 1], 1)
    arrows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#edges path'))"
        ".every(p => p.getAttribute('marker-end') === 'url(#arrow)')")
    assert arrows
    hover(browser, 'circle.node[data-index="2"]')
    classes = [c for *_, c in browser.execute_script(READ_EDGES)]
    assert any("out" in c for c in classes) and any("dim" in c for c in classes)
    assert browser.save_screenshot(str(tmp_path / "graph.png"))


def test_cross_attention_view(browser, seq2seq_page):
    path, views = seq2seq_page
    open_page(browser, path)
    select(browser, "view", "2")
    select(browser, "layer", "1")
    select(browser, "head", "0")
    _assert_drawn(browser, views[2].weights[1, 0], 0)
    # A source token (key side) highlights the target tokens that attend to it.
    hover(browser, '.token[data-side="k"][data-index="3"]')
    for _, k, _, _, classes in browser.execute_script(READ_EDGES):
        assert ("in" if k == 3 else "dim") in classes.split()


def test_vit_patches_on_the_image(browser, tmp_path):
    from selenium.webdriver.common.by import By

    weights = _weights(1, 2, 5, 5, 4)  # class token + a 2x2 grid of patches
    tokens = ["[CLS]", "p(0,0)", "p(0,1)", "p(1,0)", "p(1,1)"]
    view = PageView("ViT self-attention", "self", tokens, tokens, [0], [0, 1], weights)
    image = PageImage(torch.arange(64.0).view(1, 8, 8), (2, 2), cls_token=True)
    path = write_page(tmp_path / "vit.html", [view], mode="vit", image=image)
    open_page(browser, path)
    read = ("return Array.from(document.querySelectorAll('rect.patch'))"
            ".map(r => [Number(r.dataset.index), Number(r.dataset.weight)])")
    patches = browser.execute_script(read)
    assert [i for i, _ in patches] == [1, 2, 3, 4]
    for i, w in patches:
        assert abs(w - _kept(weights[0, 0, 0, i])) <= STORED
    hover(browser, 'rect.patch[data-index="3"]')
    for i, w in browser.execute_script(read):
        assert abs(w - _kept(weights[0, 0, 3, i])) <= STORED
    assert "p(1,0)" in browser.find_element(By.ID, "info").text
    assert browser.save_screenshot(str(tmp_path / "vit.png"))


def test_all_heads_hover_names_each_weights_head(browser, tmp_path):
    from selenium.webdriver.common.by import By

    weights = _weights(1, 3, len(TOKENS), len(TOKENS), 5)
    view = PageView("GPT self-attention", "self", TOKENS, TOKENS, [0], [0, 1, 2], weights)
    open_page(browser, write_page(tmp_path / "all.html", [view], mode="gpt"))
    select(browser, "head", "all")
    hover(browser, '.token[data-side="q"][data-index="2"]')
    first_line = browser.find_element(By.ID, "info").text.splitlines()[0]
    outs = [(k, head, w) for q, k, head, w, _ in browser.execute_script(READ_EDGES) if q == 2]
    strongest = max(outs, key=lambda e: e[2])
    assert f'"{TOKENS[strongest[0]]}" {strongest[2]:.3f} (head {strongest[1]})' in first_line


def test_long_input_matrix_zoom_mean_and_head_view_window(browser, tmp_path):
    from selenium.webdriver.common.by import By

    from .driving import _pointer_at_cell

    n = 300
    tokens = [f"t{i}" for i in range(n)]
    g = torch.Generator().manual_seed(6)
    weights = torch.softmax(6 * torch.randn(1, 2, n, n, generator=g), -1)
    view = PageView("long", "self", tokens, tokens, [0], [0, 1], weights)
    open_page(browser, write_page(tmp_path / "long.html", [view], mode="gpt"))
    # Past 160 tokens the page opens on the heatmap.
    assert browser.execute_script("return document.body.dataset.display") == "matrix"
    canvas = browser.find_element(By.ID, "matrix")
    size = json.loads(canvas.get_attribute("data-origin"))[2]
    browser.find_element(By.ID, "zoom-in").click()
    assert json.loads(canvas.get_attribute("data-origin"))[2] == pytest.approx(2 * size)
    browser.find_element(By.ID, "zoom-in").click()  # 4x: cells 112..187 are on screen
    select(browser, "head", "mean")
    canvas = _pointer_at_cell(browser, 170, 130)
    assert canvas.get_attribute("data-q") == "170" and canvas.get_attribute("data-k") == "130"
    kept = torch.where(weights >= THRESHOLD, weights, 0.0)[0, :, 170, 130].mean()
    assert abs(float(canvas.get_attribute("data-weight")) - float(kept)) <= STORED
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(browser).click().perform()  # chooses the pair; the head view moves to it
    assert '"t170" (170) -> "t130" (130)' in browser.find_element(By.ID, "pair").text
    select(browser, "display", "lines")
    select(browser, "head", "0")
    indices = {int(t.get_attribute("data-index")) for t in browser.find_elements(
        By.CSS_SELECTOR, ".token")}
    assert indices == set(range(90, 250))
    assert "tokens 90-249 of 300" in browser.find_element(By.ID, "legend").text
    drawn = _drawn(browser)
    assert drawn and all(90 <= q < 250 and 90 <= k < 250 for q, k in drawn)
    browser.execute_script("const s = document.getElementById('window-start'); s.value = 5;"
                           "s.dispatchEvent(new Event('change'))")
    assert "tokens 5-164 of 300" in browser.find_element(By.ID, "legend").text
