"""The attention page at length: file size, open time and head-switching time in headless
Chromium, for a pretrained model over a long text (issue 13's SmolLM2 target: 2,048 tokens,
all 30 layers x 9 heads, one offline file of at most 25 MB, open in under 3 s).

The text is the standard library's docstrings, cut to ``--tokens`` tokens. ``qkv viz`` runs
in this process (capture streamed layer by layer into 8-bit rows); the page then opens in
Debian's Chromium (``/usr/bin/chromium`` + chromedriver, via Selenium), and the page's own
clock gives navigation -> first view drawn. Switching heads is timed inside the page
(the change handler draws synchronously), median of ``--switches`` switches per view.

    python benchmarks/viz_page.py                                  # smollm2, 2048 tokens
    python benchmarks/viz_page.py --tokens 512 --max-per-row 32
    python benchmarks/viz_page.py --model minilm --tokens 256
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from qkv.cli import main
from qkv.data.docstrings import stdlib_docstrings
from qkv.models import load_pretrained
from qkv.viz.page import read_page

SWITCH = """
const pick = document.getElementById(arguments[0]);
const t = performance.now();
pick.value = arguments[1];
pick.dispatchEvent(new Event('change'));
return performance.now() - t;
"""


def text_of(tokenizer, tokens: int) -> str:
    """Docstring text that encodes to at most ``tokens`` tokens (specials included)."""
    ids = tokenizer.encode(stdlib_docstrings(200_000), add_special_tokens=False)
    text = tokenizer.decode(ids[: tokens - 2])
    while len(tokenizer.encode(text)) > tokens:
        text = text[: int(len(text) * 0.98)]
    return text


def browser(width=1200, height=1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", f"--window-size={width},{height}"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"),
                            options=options)


def open_ms(driver, page: Path) -> float:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get("about:blank")
    driver.get(page.resolve().as_uri())
    WebDriverWait(driver, 60).until(
        lambda d: d.execute_script("return document.body.dataset.ready") == "1")
    return float(driver.execute_script("return document.body.dataset.readyMs"))


def switch_ms(driver, display: str, heads: int, switches: int) -> float:
    driver.execute_script(SWITCH, "display", display)
    times = [driver.execute_script(SWITCH, "head", str((i + 1) % heads)) for i in range(switches)]
    return statistics.median(times)


def main_(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threshold", type=float, default=0.01)
    p.add_argument("--max-per-row", type=int)
    p.add_argument("--opens", type=int, default=3, help="page opens timed (median)")
    p.add_argument("--switches", type=int, default=9)
    p.add_argument("--keep", help="write the page here instead of a temporary folder")
    args = p.parse_args(argv)

    _, tokenizer = load_pretrained(args.model)
    text = text_of(tokenizer, args.tokens)
    folder = Path(tempfile.mkdtemp())
    page = Path(args.keep) if args.keep else folder / "page.html"
    argv = ["viz", "--model", args.model, "--text", text, "-o", str(page),
            "--threshold", str(args.threshold)]
    if args.max_per_row:
        argv += ["--max-per-row", str(args.max_per_row)]
    started = time.perf_counter()
    assert main(argv) == 0
    seconds = time.perf_counter() - started
    stored = read_page(page)
    view = stored.meta["views"][0]
    tokens, layers, heads = len(view["query_tokens"]), len(view["layers"]), len(view["heads"])
    left = [m["left_out"][0] for layer in view["maps"] for m in layer]
    entries = sum(int(stored.array(m["counts"]).sum()) for layer in view["maps"] for m in layer)

    driver = browser()
    try:
        opens = [open_ms(driver, page) for _ in range(args.opens)]
        matrix = switch_ms(driver, "matrix", heads, args.switches)
        lines = switch_ms(driver, "lines", heads, args.switches)
        model_view = driver.execute_script(SWITCH, "display", "model")
        version = driver.capabilities.get("browserVersion", "?")
    finally:
        driver.quit()

    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# qkv viz page benchmark, {now:%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads; torch "
          f"{torch.__version__}; Chromium {version} headless")
    print(f"model {args.model}: {tokens} tokens, {layers} layers x {heads} heads; threshold "
          f"{args.threshold}, max per row {args.max_per_row or 'none'}")
    print("| measure | value |\n| --- | --- |")
    print(f"| qkv viz (load, forward, capture, write) | {seconds:.1f} s |")
    print(f"| page file | {page.stat().st_size / 2**20:.2f} MiB |")
    print(f"| stored weights | {entries:,} ({entries / (layers * heads * tokens):.1f} per "
          f"query row) |")
    print(f"| attention left out, mean over heads | {100 * statistics.mean(left):.2f}% "
          f"(worst head {100 * max(left):.2f}%) |")
    print(f"| open to first view (median of {args.opens}) | {statistics.median(opens):.0f} ms "
          f"(all: {', '.join(f'{t:.0f}' for t in opens)}) |")
    print(f"| switch head, matrix view (median) | {matrix:.1f} ms |")
    print(f"| switch head, head view (median) | {lines:.1f} ms |")
    print(f"| open the model view ({layers * heads} thumbnails) | {model_view:.0f} ms |")


if __name__ == "__main__":
    main_()
