"""Regenerate the viewer screenshots in docs/img (docs/viz.md shows them).

    PYTHONPATH=src python docs/img/viz_screenshots.py

Writes MiniLM and SmolLM2 pages with ``qkv viz --model`` into a temporary folder, opens them
in Debian's headless Chromium and saves one small PNG per view (quantized to 64 colours)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from qkv.cli import main  # noqa: E402
from viz_page import browser, open_ms  # noqa: E402

HERE = Path(__file__).resolve().parent
SWITCH = ("const p = document.getElementById(arguments[0]); p.value = arguments[1];"
          "p.dispatchEvent(new Event('change'));")


def shot(driver, name: str, crop: tuple[int, int]) -> None:
    raw = HERE / f"{name}.raw.png"
    driver.save_screenshot(str(raw))
    image = Image.open(raw).convert("RGB").crop((0, 0, *crop))
    image.quantize(64).save(HERE / f"{name}.png", optimize=True)
    raw.unlink()
    print(HERE / f"{name}.png")


def set_(driver, **choices) -> None:
    for element, value in choices.items():
        driver.execute_script(SWITCH, element, value)


def main_() -> None:
    folder = Path(tempfile.mkdtemp())
    minilm, smol = folder / "minilm.html", folder / "smollm2.html"
    assert main(["viz", "--model", "minilm", "--text",
                 "The cat sat on the mat because it was warm.", "-o", str(minilm)]) == 0
    assert main(["viz", "--model", "smollm2", "--chat", "--text", "Name three colours.",
                 "--generate", "12", "-o", str(smol)]) == 0
    driver = browser(1000, 1100)  # a viewport of about 1000 x 950
    try:
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By

        open_ms(driver, minilm)
        set_(driver, display="lines", layer="2", head="all")
        token = driver.find_element(By.CSS_SELECTOR, '.token[data-side="q"][data-index="2"]')
        ActionChains(driver).move_to_element(token).perform()
        shot(driver, "viz-head-view", (760, 560))
        set_(driver, display="neuron", layer="0", head="3")
        shot(driver, "viz-neuron-view", (1000, 560))
        set_(driver, display="matrix", layer="rollout")
        shot(driver, "viz-rollout", (760, 760))
        open_ms(driver, smol)
        set_(driver, display="matrix", layer="5", head="4")
        canvas = driver.find_element(By.ID, "matrix")
        ActionChains(driver).move_to_element_with_offset(canvas, 60, 120).perform()
        shot(driver, "viz-matrix-view", (1000, 900))
        set_(driver, display="model")
        shot(driver, "viz-model-view", (620, 900))
        set_(driver, display="summary")
        driver.find_element(By.CSS_SELECTOR, 'th[data-column="sink (first token)"]').click()
        shot(driver, "viz-head-summary", (760, 420))
    finally:
        driver.quit()


if __name__ == "__main__":
    main_()
