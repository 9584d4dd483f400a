"""``qkv.viz.show`` in a notebook: a real notebook run by a real kernel (nbclient, ipykernel)
renders the page inline, and the rendered output, opened in headless Chromium, draws the
attention the model computed. The page equals the one ``qkv viz`` writes for the same text,
for a pretrained name and a Hugging Face model running on qkv."""

from __future__ import annotations

import html
import re

import numpy as np
import pytest
import torch

import qkv.viz
from qkv.viz.page import read_page

from .driving import check_head_view, open_page

TEXT = "Attention is all you need."


def _page_of(view, tmp_path, name="page.html"):
    return read_page(view.save(tmp_path / name))


def test_show_is_the_viz_page_of_a_pretrained_model(tmp_path):
    from qkv.cli import main

    view = qkv.viz.show("minilm", TEXT, layers=[0, -1], heads=[1, 2])
    assert view.html.startswith("<!DOCTYPE html>")
    frame = view._repr_html_()
    assert frame.startswith('<iframe srcdoc="') and 'sandbox="allow-scripts"' in frame
    assert html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1)) == view.html
    out = tmp_path / "cli.html"
    assert main(["viz", "--model", "minilm", "--text", TEXT, "--layers", "0,-1",
                 "--heads", "1,2", "-o", str(out)]) == 0
    shown, written = _page_of(view, tmp_path), read_page(out)
    assert shown.meta["views"][0]["query_tokens"] == written.meta["views"][0]["query_tokens"]
    for layer in range(2):
        for head in range(2):
            np.testing.assert_array_equal(shown.weights(0, layer, head),
                                          written.weights(0, layer, head))


def test_show_a_transformers_model_on_qkv(tmp_path):
    import transformers as tf

    from qkv.integrations.transformers import register
    from qkv.models.pretrained import resolve

    path = resolve("minilm")
    model = tf.BertModel.from_pretrained(path, dtype=torch.float32,
                                         attn_implementation=register()).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    view = qkv.viz.show(model, TEXT, tokenizer=tokenizer, layers=[2], heads=[0])
    stored = _page_of(view, tmp_path)
    ids = tokenizer(TEXT, return_tensors="pt")["input_ids"]
    model.set_attn_implementation("eager")
    with torch.no_grad():
        eager = model(input_ids=ids, output_attentions=True).attentions[2][0, 0].numpy()
    kept = stored.weights(0, 0, 0)
    assert kept.shape == eager.shape
    assert np.abs(kept - np.where(kept > 0, eager, 0)).max() <= 0.5 / 255 + 1e-6
    assert (eager[kept == 0] < 0.01 + 1e-6).all()  # what the page leaves out is below 0.01


def test_bad_arguments_say_what_is_expected():
    with pytest.raises(ValueError, match="text must be a non-empty string"):
        qkv.viz.show("minilm", "")
    with pytest.raises(ValueError, match="needs tokenizer="):
        qkv.viz.show(torch.nn.Linear(2, 2), TEXT)
    with pytest.raises(TypeError, match="model_or_name must be a pretrained name"):
        qkv.viz.show(torch.nn.Linear(2, 2), TEXT, tokenizer=object())
    with pytest.raises(ValueError, match="height must be an int of at least 100"):
        qkv.viz.show("minilm", TEXT, height=10)


NOTEBOOK_CELLS = [
    "import qkv.viz",
    f"view = qkv.viz.show('minilm', {TEXT!r}, layers=[0], heads=[0])\nview",
]


@pytest.mark.slow
def test_a_notebook_renders_the_page_inline(tmp_path, browser):
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.v4.new_notebook(
        cells=[nbformat.v4.new_code_cell(source) for source in NOTEBOOK_CELLS])
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = notebook.cells[-1].outputs
    assert [o["output_type"] for o in outputs] == ["execute_result"]
    frame = outputs[0]["data"]["text/html"]
    assert frame.startswith('<iframe srcdoc="')
    # The rendered output, as a notebook front end shows it, in a browser.
    page = tmp_path / "notebook-output.html"
    page.write_text(f"<!DOCTYPE html><html><body>{frame}</body></html>", encoding="utf-8")
    inner = tmp_path / "inner.html"
    inner.write_text(html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1)),
                     encoding="utf-8")
    browser.get(page.resolve().as_uri())
    browser.switch_to.frame(browser.find_element("tag name", "iframe"))
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 20).until(
        lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    assert browser.find_element("id", "view").text.startswith("minilm")
    browser.switch_to.default_content()
    # What the frame draws is what the page stores.
    open_page(browser, inner)
    check_head_view(browser, read_page(inner), 0, 0, 0)
