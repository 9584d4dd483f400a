"""viz.patching_view: a patching grid's cells carry the effects and their colours, the
page is static and self-contained, and Chromium draws it inline with no console message."""

from __future__ import annotations

import html
import re
import xml.etree.ElementTree as ET

import pytest
import torch

from qkv import viz

from .conftest import headless_chromium

EFFECTS = torch.tensor([[-12.0, -11.0, -12.5], [-10.0, -12.0, -12.0]])  # (2 layers, 3 heads)


def cells(svg: str) -> list[ET.Element]:
    return [e for e in ET.fromstring(svg).iter() if e.get("class") == "cell"]


def test_cells_hold_the_effects_and_their_sign_colours():
    svg = viz.patching_svg(EFFECTS, rows=["17", "18"], reference=-12.0)
    found = cells(svg)
    assert [float(c.get("data-value")) for c in found] == EFFECTS.flatten().tolist()
    fills = [c.get("fill") for c in found]
    assert fills[0] == fills[4] == "rgb(255,255,255)"  # at the reference
    assert fills[3] == "rgb(255,0,0)"  # the largest effect above it: full red
    assert fills[1] == "rgb(255,128,128)"  # half of it
    assert fills[2] == "rgb(191,191,255)"  # a quarter of it below: light blue
    titles = [c.find("{http://www.w3.org/2000/svg}title").text for c in found]
    assert titles[3] == "layer 18, head 0: -10"


def test_resid_grid_names_its_positions_and_the_page_is_static():
    view = viz.patching_view(EFFECTS, columns=["The", "<cat>", "sat"],
                                 column_title="position", title="resid patching")
    page = view.html
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    assert "&lt;cat&gt;" in page and "position" in page
    assert view._repr_html_().startswith('<iframe srcdoc="')


@pytest.mark.parametrize("bad, message", [
    (dict(effects=torch.zeros(3)), "effects must be a 2-D tensor"),
    (dict(effects=torch.tensor([[float("nan")]])), "effects must be finite"),
    (dict(effects=EFFECTS, rows=["a"]), "rows and columns must name the grid's 2 rows"),
    (dict(effects=EFFECTS, reference=float("inf")), "reference must be a finite number"),
])
def test_bad_input_names_the_argument(bad, message):
    with pytest.raises(ValueError, match=message):
        viz.patching_view(**bad)


@pytest.fixture(scope="module")
def console_browser(tmp_path_factory):
    yield from headless_chromium(tmp_path_factory, keep_console=True)


def test_chromium_draws_the_grid_inline(tmp_path, console_browser):
    frame = viz.patching_view(EFFECTS, reference=-12.0)._repr_html_()
    page = tmp_path / "notebook-output.html"
    page.write_text(f"<!DOCTYPE html><html><body>{frame}</body></html>", encoding="utf-8")
    console_browser.get(page.resolve().as_uri())
    console_browser.switch_to.frame(console_browser.find_element("tag name", "iframe"))
    drawn = console_browser.execute_script(
        "return Array.from(document.querySelectorAll('rect.cell')).map(r => "
        "[r.getAttribute('data-value'), r.getBoundingClientRect().width])")
    assert [float(v) for v, _ in drawn] == EFFECTS.flatten().tolist()
    assert all(width > 20 for _, width in drawn)
    console_browser.switch_to.default_content()
    assert console_browser.get_log("browser") == []
    inner = html.unescape(re.search(r'srcdoc="([^"]*)"', frame).group(1))
    assert inner.count("<td>") == EFFECTS.numel()
