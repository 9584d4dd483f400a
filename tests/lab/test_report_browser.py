"""report.html in a real headless Chromium: it loads with no console error and fetches
nothing, and shows the table (within-noise rows greyed and marked), the loss curves with
their bands, and the attention summaries."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from qkv.lab import report

from ..viz.conftest import headless_chromium
from .conftest import finished_lab

LAB = """
[lab]
task = "lm"
preset = "tiny"
seeds = [0, 1]
set = ["train.steps=3"]
[variants.dot]
[variants.l1]
set = ["model.block.similarity=l1"]
"""
GREY = "rgb(119, 119, 119)"  # tr.noise td: #777


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """Headless Chromium, as tests/viz drive it, also keeping the page's console."""
    yield from headless_chromium(tmp_path_factory, keep_console=True)


@pytest.fixture(scope="module")
def lab_out(tmp_path_factory):
    return finished_lab(tmp_path_factory, LAB)


def load(driver, path) -> list[dict]:
    """Open the page; the console messages it logged."""
    driver.get(path.resolve().as_uri())
    assert driver.execute_script("return document.readyState") == "complete"
    return driver.get_log("browser")


def rows(driver, table: str) -> list[list[str]]:
    return driver.execute_script(f"""return Array.from(document.querySelectorAll(
        '{table} tbody tr')).map(r => Array.from(r.cells).map(c => c.textContent));""")


def test_the_page_renders_offline_with_the_table_curves_and_summaries(chromium, lab_out):
    console = load(chromium, lab_out / "report.html")
    assert [m for m in console if m["level"] in ("SEVERE", "WARNING")] == []
    fetched = chromium.execute_script(
        "return performance.getEntriesByType('resource').map(e => e.name)")
    assert fetched == []
    results = json.loads((lab_out / "results.json").read_text())
    table = rows(chromium, "table:not(.attention)")
    assert [r[0] for r in table] == ["dot", "l1"]
    assert table[0][1] == f"{results['variants']['dot']['mean']:.4f}"
    assert table[1][4] == f"{results['variants']['l1']['vs_baseline']['difference']:+.4f}"
    # One band and one mean line per variant, drawn with a width and a height.
    for shape in ("polygon", "polyline"):
        boxes = chromium.execute_script(f"""return Array.from(document.querySelectorAll(
            'svg {shape}')).map(e => {{ const b = e.getBBox(); return [b.width, b.height]; }});""")
        assert len(boxes) == 2 and all(w > 100 and h > 0 for w, h in boxes), (shape, boxes)
    summaries = rows(chromium, "table.attention")
    assert [r[0] for r in summaries] == ["dot", "l1"]  # one layer each (the tiny preset)
    entropy = results["variants"]["l1"]["attention"]["layers"][0]["entropy_bits"]
    assert summaries[1][2] == f"{entropy:.3f}"
    assert "nats per token" in chromium.find_element("css selector", "p.unigram").text


@pytest.mark.parametrize("noise", [True, False])
def test_a_within_noise_row_is_greyed_and_marked(chromium, lab_out, tmp_path, noise):
    results = copy.deepcopy(json.loads((lab_out / "results.json").read_text()))
    vs = results["variants"]["l1"]["vs_baseline"]
    vs["within_noise"] = noise
    shutil.copytree(lab_out / "runs", tmp_path / "runs")
    report.write(results, tmp_path)
    assert load(chromium, tmp_path / "report.html") == []
    style = chromium.execute_script("""const r = document.querySelectorAll('tbody tr')[1];
        const v = r.querySelector('td.verdict');
        return [r.className, getComputedStyle(r.cells[1]).color, v.textContent,
                getComputedStyle(v).fontStyle];""")
    if noise:
        assert style == ["noise", GREY, "within noise", "italic"]
    else:
        word = "better" if vs["difference"] < 0 else "worse"
        assert style[0] == "" and style[1] != GREY and style[2] == word
        assert style[3] == "normal"
