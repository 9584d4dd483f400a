"""The attention page at length: the command's wall time, CPU time and peak memory, the file
size, and open and head-switching times in headless Chromium, for a pretrained model over a
long text (SmolLM2's targets: 2,048 tokens with every map, issue 13; 8,192 tokens with every
head's per-row summaries and the chosen heads' maps in at most 3 min, 3 GB and 25 MB, issue
47).

The text is the standard library's docstrings, cut to ``--tokens`` tokens and written to a
file. ``qkv viz --model M --text-file FILE -o page.html`` runs as its own process, so its peak
resident memory (``getrusage(RUSAGE_CHILDREN)``) is the command's alone; the load average
before and after says whether other work shared the cores. The page then opens in Debian's
Chromium (``/usr/bin/chromium`` + chromedriver, via Selenium), and the page's own clock
gives navigation -> first view drawn. Switching heads is timed inside the page (the change
handler draws synchronously), median of ``--switches`` switches per view.

    python benchmarks/viz_page.py                                  # smollm2, 2048 tokens
    python benchmarks/viz_page.py --tokens 8192 --layers 0,15,29   # summaries + 27 maps
    python benchmarks/viz_page.py --tokens 512 --max-per-row 32
    python benchmarks/viz_page.py --model minilm --tokens 256
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

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
    p.add_argument("--layers", help="qkv viz --layers (past 2,048 tokens: the mapped layers)")
    p.add_argument("--heads", help="qkv viz --heads")
    p.add_argument("--threads", type=int, default=2,
                   help="qkv --threads (the command takes fewer on a busy machine otherwise)")
    p.add_argument("--opens", type=int, default=3, help="page opens timed (median)")
    p.add_argument("--switches", type=int, default=9)
    p.add_argument("--keep", help="write the page here instead of a temporary folder")
    args = p.parse_args(argv)

    _, tokenizer = load_pretrained(args.model)
    folder = Path(tempfile.mkdtemp())
    text = folder / "text.txt"
    text.write_text(text_of(tokenizer, args.tokens), encoding="utf-8")
    page = Path(args.keep) if args.keep else folder / "page.html"
    # The environment's own ``qkv`` command, beside its Python.
    argv = [str(Path(sys.executable).with_name("qkv")), "viz", "--model", args.model,
            "--text-file", str(text), "-o", str(page), "--threshold", str(args.threshold)]
    for flag in ("max_per_row", "layers", "heads", "threads"):
        if getattr(args, flag):
            argv += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    subprocess.run(argv, check=True)
    seconds = time.perf_counter() - started
    load_after = os.getloadavg()[0]
    child = resource.getrusage(resource.RUSAGE_CHILDREN)
    stored = read_page(page)
    view = stored.meta["views"][0]
    tokens, layers, heads = len(view["query_tokens"]), len(view["layers"]), len(view["heads"])
    maps = [m for layer in view["maps"] for m in layer if m is not None]
    left = [m["left_out"][0] for m in maps]
    entries = sum(int(stored.array(m["counts"]).sum()) for m in maps)

    driver = browser()
    try:
        opens = [open_ms(driver, page) for _ in range(args.opens)]
        matrix = switch_ms(driver, "matrix", heads, args.switches)
        lines = switch_ms(driver, "lines", heads, args.switches)
        rows = switch_ms(driver, "rows", heads, args.switches) if view["row_stats"] else None
        model_view = driver.execute_script(SWITCH, "display", "model")
        version = driver.capabilities.get("browserVersion", "?")
    finally:
        driver.quit()

    now = datetime.datetime.now(datetime.timezone.utc)
    print(f"# qkv viz page benchmark, {now:%Y-%m-%d %H:%M} UTC")
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} torch threads; torch "
          f"{torch.__version__}; Chromium {version} headless")
    print(f"model {args.model}: {tokens} tokens, {layers} layers x {heads} heads; threshold "
          f"{args.threshold}, max per row {stored.meta['max_per_row'] or 'none'}; "
          f"{len(maps)} maps" + (", every head's per-row summaries" if view["row_stats"] else ""))
    print("command: qkv " + " ".join(argv[1:]))
    print(f"load average (1 min) before {load_before:.2f}, after {load_after:.2f}")
    print("| measure | value |\n| --- | --- |")
    print(f"| qkv viz (load, forward, summaries and maps, write), wall | {seconds:.1f} s |")
    print(f"| qkv viz, CPU time (user + system) | {child.ru_utime + child.ru_stime:.1f} s |")
    print(f"| qkv viz, peak resident memory | {child.ru_maxrss / 2**20:.2f} GiB |")
    print(f"| page file | {page.stat().st_size / 2**20:.2f} MiB "
          f"({page.stat().st_size / 1e6:.1f} MB) |")
    print(f"| stored weights | {entries:,} ({entries / (len(maps) * tokens):.1f} per "
          f"query row of a mapped head) |")
    print(f"| attention left out, mean over the mapped heads | {100 * statistics.mean(left):.2f}%"
          f" (worst head {100 * max(left):.2f}%) |")
    print(f"| open to first view (median of {args.opens}) | {statistics.median(opens):.0f} ms "
          f"(all: {', '.join(f'{t:.0f}' for t in opens)}) |")
    print(f"| switch head, matrix view (median) | {matrix:.1f} ms |")
    print(f"| switch head, head view (median) | {lines:.1f} ms |")
    if rows is not None:
        print(f"| switch head, per-row summaries (median) | {rows:.1f} ms |")
    print(f"| open the model view ({layers * heads} thumbnails) | {model_view:.0f} ms |")


if __name__ == "__main__":
    main_()
