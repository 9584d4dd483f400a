"""Driving the attention page in Chromium, and checking each view against the stored weights
(``qkv.viz.page.read_page``): what a view shows must be what the page holds."""

from __future__ import annotations

import json

import numpy as np

STORED = 0.5 / 255 + 1e-4  # the page keeps a weight to 1/255 and shows 4 decimals
READ_EDGES = """
return Array.from(document.querySelectorAll('#edges .edge')).map(e => [
  Number(e.dataset.q), Number(e.dataset.k), e.dataset.head, Number(e.dataset.weight),
  e.getAttribute('class')]);
"""


def open_page(driver, path):
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(path.resolve().as_uri())
    WebDriverWait(driver, 10).until(
        lambda d: d.execute_script("return document.body.dataset.ready") == "1")


def select(driver, element_id, value):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element(By.ID, element_id)).select_by_value(value)


def hover(driver, css):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    ActionChains(driver).move_to_element(driver.find_element(By.CSS_SELECTOR, css)).perform()


def show(driver, display, view=0, layer="0", head="0"):
    select(driver, "view", str(view))
    select(driver, "display", display)
    select(driver, "layer", str(layer))
    select(driver, "head", str(head))
    assert driver.execute_script("return document.body.dataset.display") == display


def check_head_view(driver, stored, view, layer, head):
    """Lines between tokens: every drawn edge is a stored weight and vice versa."""
    show(driver, "lines", view, layer, head)
    want = stored.weights(view, layer, head)
    drawn = {(q, k): w for q, k, _, w, _ in driver.execute_script(READ_EDGES)}
    assert drawn.keys() == {tuple(map(int, i)) for i in np.argwhere(want > 0)}
    for (q, k), w in drawn.items():
        assert abs(w - want[q, k]) <= 1e-4, (q, k, w, want[q, k])


def _pointer_at_cell(driver, q, k):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    canvas = driver.find_element(By.ID, "matrix")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'})", canvas)
    # Where cell (0, 0) sits on the canvas and its size, as the page painted it.
    x0, y0, size = json.loads(canvas.get_attribute("data-origin"))
    rect = canvas.rect
    x = x0 + (k + 0.5) * size - rect["width"] / 2
    y = y0 + (q + 0.5) * size - rect["height"] / 2
    ActionChains(driver).move_to_element_with_offset(canvas, round(x), round(y)).perform()
    return canvas


def check_matrix_view(driver, stored, view, layer, head, cells):
    """The heatmap: the cell under the pointer names its tokens and shows its weight."""
    show(driver, "matrix", view, layer, head)
    meta = stored.meta["views"][view]
    want = stored.weights(view, layer, head)
    # The page says what it leaves out of this head.
    mean, worst = meta["maps"][layer][head]["left_out"]
    omitted = driver.find_element("id", "omitted").text
    assert f"{100 * mean:.2f}% of a query's attention on average, {100 * worst:.2f}% at most" \
        in omitted, omitted
    for q, k in cells:
        canvas = _pointer_at_cell(driver, q, k)
        assert (int(canvas.get_attribute("data-q")), int(canvas.get_attribute("data-k"))) == \
            (q, k)
        assert abs(float(canvas.get_attribute("data-weight")) - want[q, k]) <= 1e-4
        info = driver.find_element("id", "info").text
        assert json.dumps(meta["query_tokens"][q], ensure_ascii=False) in info
        assert json.dumps(meta["key_tokens"][k], ensure_ascii=False) in info


def check_model_view(driver, stored, view):
    """Every layer x head is a thumbnail; a click opens that head in the matrix view."""
    from selenium.webdriver.common.by import By

    show(driver, "model", view)
    meta = stored.meta["views"][view]
    thumbs = driver.find_elements(By.CSS_SELECTOR, "#model-grid canvas.thumb")
    assert len(thumbs) == len(meta["layers"]) * len(meta["heads"])
    last = len(meta["layers"]) - 1, len(meta["heads"]) - 1
    driver.find_element(
        By.CSS_SELECTOR, f'canvas.thumb[data-layer="{last[0]}"][data-head="{last[1]}"]').click()
    body = driver.execute_script("return Object.assign({}, document.body.dataset)")
    assert (body["display"], body["layer"], body["head"]) == ("matrix", str(last[0]),
                                                               str(last[1]))


def check_neuron_view(driver, stored, view, layer, head, pair):
    """The per-dimension terms' total equals the score the layer used for the pair."""
    from selenium.webdriver.common.by import By

    show(driver, "neuron", view, layer, head)
    # Typing the pair (the page redraws on each change, so both values go in at once).
    driver.execute_script(
        "document.getElementById('neuron-q').value = arguments[0];"
        "const k = document.getElementById('neuron-k'); k.value = arguments[1];"
        "k.dispatchEvent(new Event('change'))", *pair)
    shown = [int(driver.find_element(By.ID, i).get_attribute("value"))
             for i in ("neuron-q", "neuron-k")]
    assert tuple(shown) == tuple(pair)
    total = float(driver.find_element(By.ID, "neuron-total").get_attribute("data-value"))
    score = float(driver.find_element(By.ID, "neuron-score").get_attribute("data-value"))
    assert abs(total - score) <= 1e-4 * max(1.0, abs(score)), (total, score)
    neuron = next(n for n in stored.meta["views"][view]["neurons"] if n["layer"] == layer)
    bars = driver.find_elements(By.CSS_SELECTOR, "rect.bar")
    assert len(bars) == 3 * neuron["dims"]
    return total


def check_summary(driver, stored, view):
    """The head summary lists every head; sorting by the sink column orders it."""
    from selenium.webdriver.common.by import By

    show(driver, "summary", view)
    meta = stored.meta["views"][view]
    rows = driver.find_elements(By.CSS_SELECTOR, "#summary tbody tr")
    assert len(rows) == len(meta["layers"]) * len(meta["heads"])
    driver.find_element(By.CSS_SELECTOR, 'th[data-column="sink (first token)"]').click()
    cells = driver.execute_script(
        "return Array.from(document.querySelectorAll('#summary tbody tr')).map(r => "
        "[Number(r.dataset.layer), Number(r.dataset.head), "
        "Number(r.children[4].dataset.value)])")
    sinks = [s for _, _, s in cells]
    assert sinks == sorted(sinks, reverse=True)
    for li, hi, sink in cells:
        assert abs(sink - meta["summary"][li][hi][2]) <= 1e-9


def check_every_view(driver, page, stored, view=0, *, neuron_pair=None):
    """Open each view of one attention site and check it against the stored weights."""
    open_page(driver, page)
    meta = stored.meta["views"][view]
    last_layer = len(meta["layers"]) - 1
    check_head_view(driver, stored, view, last_layer, 0)
    nq, nk = len(meta["query_tokens"]), len(meta["key_tokens"])
    check_matrix_view(driver, stored, view, last_layer, len(meta["heads"]) - 1,
                      [(0, 0), (nq - 1, nk - 1), (nq // 2, nk // 3)])
    check_model_view(driver, stored, view)
    check_summary(driver, stored, view)
    if meta["neurons"]:
        neuron_layer = meta["neurons"][0]["layer"]
        want = stored.weights(view, neuron_layer, 0)
        pair = neuron_pair or tuple(int(i) for i in np.argwhere(want > 0)[-1])
        check_neuron_view(driver, stored, view, neuron_layer, 0, pair)
