"""The interactive page in a real headless Chromium: pick a head, hover a token, graph view,
cross-attention and the ViT's patches; the weights drawn are read back from the DOM."""

from __future__ import annotations

import pytest
import torch

from qkv.viz import PageImage, PageView, write_page

THRESHOLD = 0.01
TOKENS = ["The", "cat", "sat", "on", "the", "mat"]
READ_EDGES = """
return Array.from(document.querySelectorAll('#edges .edge')).map(e => [
  Number(e.dataset.q), Number(e.dataset.k), e.dataset.head, Number(e.dataset.weight),
  e.getAttribute('class')]);
"""


def test_missing_browser_skips_locally_and_fails_in_ci():
    from .conftest import unavailable

    assert unavailable(None, "true") is None
    action, message = unavailable("/usr/bin/chromium is missing", None)
    assert action == "skip" and "apt-get install chromium chromium-driver" in message
    assert unavailable("/usr/bin/chromium is missing", "true")[0] == "fail"


def _weights(layers, heads, nq, nk, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(3 * torch.randn(layers, heads, nq, nk, generator=g), -1)


STORED = 0.5 / 255 + 1e-4  # the page keeps a weight to 1/255 and shows 4 decimals


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


def _open(driver, path):
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 10).until(
        lambda d: d.execute_script("return document.body.dataset.ready") == "1")


def _select(driver, element_id, value):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, element_id)).select_by_value(value)


def _hover(driver, css):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ActionChains(driver).move_to_element(driver.find_element(By.CSS_SELECTOR, css)).perform()


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
    _open(browser, path)
    _assert_drawn(browser, weights[0, 0], 0)

    _select(browser, "head", "2")
    _assert_drawn(browser, weights[0, 2], 2)
    _select(browser, "layer", "1")
    _assert_drawn(browser, weights[1, 2], 2)

    _hover(browser, '.token[data-side="q"][data-index="1"]')
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

    _select(browser, "head", "all")
    heads = {head for _, _, head, _, _ in browser.execute_script(READ_EDGES)}
    assert heads == {"0", "1", "2"}


def test_graph_view_draws_the_layer_as_directed_edges(browser, seq2seq_page, tmp_path):
    path, views = seq2seq_page
    _open(browser, path)
    _select(browser, "display", "graph")
    _select(browser, "head", "1")
    _assert_drawn(browser, views[0].weights[0, 1], 1)
    arrows = browser.execute_script(
        "return Array.from(document.querySelectorAll('#edges path'))"
        ".every(p => p.getAttribute('marker-end') === 'url(#arrow)')")
    assert arrows
    _hover(browser, 'circle.node[data-index="2"]')
    classes = [c for *_, c in browser.execute_script(READ_EDGES)]
    assert any("out" in c for c in classes) and any("dim" in c for c in classes)
    assert browser.save_screenshot(str(tmp_path / "graph.png"))


def test_cross_attention_view(browser, seq2seq_page):
    path, views = seq2seq_page
    _open(browser, path)
    _select(browser, "view", "2")
    _select(browser, "layer", "1")
    _select(browser, "head", "0")
    _assert_drawn(browser, views[2].weights[1, 0], 0)
    # A source token (key side) highlights the target tokens that attend to it.
    _hover(browser, '.token[data-side="k"][data-index="3"]')
    for _, k, _, _, classes in browser.execute_script(READ_EDGES):
        assert ("in" if k == 3 else "dim") in classes.split()


def test_vit_patches_on_the_image(browser, tmp_path):
    from selenium.webdriver.common.by import By

    weights = _weights(1, 2, 5, 5, 4)  # class token + a 2x2 grid of patches
    tokens = ["[CLS]", "p(0,0)", "p(0,1)", "p(1,0)", "p(1,1)"]
    view = PageView("ViT self-attention", "self", tokens, tokens, [0], [0, 1], weights)
    image = PageImage(torch.arange(64.0).view(1, 8, 8), (2, 2), cls_token=True)
    path = write_page(tmp_path / "vit.html", [view], mode="vit", image=image)
    _open(browser, path)
    read = ("return Array.from(document.querySelectorAll('rect.patch'))"
            ".map(r => [Number(r.dataset.index), Number(r.dataset.weight)])")
    patches = browser.execute_script(read)
    assert [i for i, _ in patches] == [1, 2, 3, 4]
    for i, w in patches:
        assert abs(w - _kept(weights[0, 0, 0, i])) <= STORED
    _hover(browser, 'rect.patch[data-index="3"]')
    for i, w in browser.execute_script(read):
        assert abs(w - _kept(weights[0, 0, 3, i])) <= STORED
    assert "p(1,0)" in browser.find_element(By.ID, "info").text
    assert browser.save_screenshot(str(tmp_path / "vit.png"))
