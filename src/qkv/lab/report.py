"""``report.html``: one offline page (no script, no network resource) with the training loss
curves (the mean over seeds, a band from the lowest to the highest seed), the results table
with within-noise differences marked, speed and memory, and (lm) each variant's attention
summaries on held-out text against the text's unigram entropy."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from ..data.atomic import write_text_atomic
from .results import fmt_memory, fmt_rate, verdict

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#393b79", "#637939")
WIDTH, HEIGHT, PAD = 720, 320, 48
STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:60em;color:#222}
table{border-collapse:collapse}td,th{padding:.25em .7em;border-bottom:1px solid #ddd;
text-align:right}td:first-child,th:first-child{text-align:left}
tr.noise td{color:#777}tr.noise td.verdict{font-style:italic}
.better{color:#2ca02c}.worse{color:#d62728}.key span{margin-right:1.2em}"""


def curve(run_dir: Path) -> dict[int, float]:
    """step -> training loss from the run's metrics."""
    points = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record:
            points[record["step"]] = record["loss"]
    return points


def bands(out: Path, entry: dict) -> list[tuple[int, float, float, float]]:
    """(step, mean, lowest, highest) over the seeds, at the steps every seed recorded."""
    curves = [curve(out / d["run_dir"]) for d in entry["runs"]]
    if not curves:
        return []
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    return [(s, sum(c[s] for c in curves) / len(curves), min(c[s] for c in curves),
             max(c[s] for c in curves)) for s in steps]


def svg(series: dict[str, list[tuple[int, float, float, float]]]) -> str:
    drawn = {name: b for name, b in series.items() if b}
    if not drawn:
        return "<p>No finished run to draw.</p>"
    steps = [p[0] for b in drawn.values() for p in b]
    lows = [p[2] for b in drawn.values() for p in b]
    highs = [p[3] for b in drawn.values() for p in b]
    x0, x1, y0, y1 = min(steps), max(steps), min(lows), max(highs)
    sx = lambda s: PAD + (s - x0) / max(x1 - x0, 1) * (WIDTH - 2 * PAD)  # noqa: E731
    sy = lambda v: HEIGHT - PAD - (v - y0) / max(y1 - y0, 1e-12) * (HEIGHT - 2 * PAD)  # noqa: E731
    parts = [f'<svg width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" role="img" aria-label="training loss">',
             f'<rect x="{PAD}" y="{PAD}" width="{WIDTH - 2 * PAD}" '
             f'height="{HEIGHT - 2 * PAD}" fill="none" stroke="#ccc"/>',
             f'<text x="{PAD}" y="{PAD - 8}" font-size="12">{y1:.3f}</text>',
             f'<text x="{PAD}" y="{HEIGHT - PAD + 16}" font-size="12">{y0:.3f} | step {x0}'
             f'</text><text x="{WIDTH - PAD}" y="{HEIGHT - PAD + 16}" font-size="12" '
             f'text-anchor="end">step {x1}</text>']
    for i, (name, b) in enumerate(drawn.items()):
        color = COLORS[i % len(COLORS)]
        upper = " ".join(f"{sx(s):.1f},{sy(hi):.1f}" for s, _, _, hi in b)
        lower = " ".join(f"{sx(s):.1f},{sy(lo):.1f}" for s, _, lo, _ in reversed(b))
        mean = " ".join(f"{sx(s):.1f},{sy(m):.1f}" for s, m, _, _ in b)
        parts += [f'<polygon points="{upper} {lower}" fill="{color}" fill-opacity="0.15" '
                  f'stroke="none"><title>{escape(name)}: lowest to highest seed</title>'
                  '</polygon>',
                  f'<polyline points="{mean}" fill="none" stroke="{color}" '
                  f'stroke-width="1.5"><title>{escape(name)}: mean over seeds</title>'
                  '</polyline>']
    parts.append("</svg>")
    key = "".join(f'<span style="color:{COLORS[i % len(COLORS)]}">&#9632; {escape(n)}</span>'
                  for i, n in enumerate(drawn))
    return "\n".join(parts) + f'\n<p class="key">{key}</p>'


def row(name: str, e: dict, lower: bool) -> str:
    vs, word = e["vs_baseline"], verdict(e, lower)
    score = f"{e['mean']:.4f}" if e["n"] else "&#8212;"
    spread = f"{e['std']:.4f}" if e["std"] is not None else ""
    diff = interval = ""
    if vs is not None:
        diff = f"{vs['difference']:+.4f}"
        if vs["interval"] is not None:
            interval = f"[{vs['interval'][0]:+.4f}, {vs['interval'][1]:+.4f}]"
    params = e["runs"][0]["parameters"] if e["runs"] else ""
    css = {"within noise": "noise"}.get(word, "")
    cells = [escape(name), score, spread, str(e["n"]), diff, interval,
             f'<span class="{word}">{escape(word)}</span>' if word else "",
             escape(fmt_rate(e)), escape(fmt_memory(e)), f"{params:,}" if params else ""]
    tds = "".join(f'<td class="verdict">{c}</td>' if i == 6 else f"<td>{c}</td>"
                  for i, c in enumerate(cells))
    failed = "".join(f'<tr class="failed"><td>{escape(name)}-s{f["seed"]}</td>'
                     f'<td colspan="9" style="text-align:left">failed: {escape(f["error"])}'
                     "</td></tr>" for f in e["failed"])
    return f'<tr class="{css}">{tds}</tr>{failed}'


def attention_table(results: dict) -> str:
    """Per variant and layer: mean entropy, sink mass and attention distance on held-out
    text (``qkv.lab.attention``), averaged over the variant's seeds."""
    rows = []
    for name, e in results["variants"].items():
        found = e.get("attention")
        if not found:
            continue
        if "error" in found:
            rows.append(f'<tr class="failed"><td>{escape(name)}</td><td colspan="4" '
                        f'style="text-align:left">no summaries: {escape(found["error"])}'
                        "</td></tr>")
            continue
        for i, layer in enumerate(found["layers"]):
            rows.append(f"<tr><td>{escape(name) if i == 0 else ''}</td><td>{i}</td>"
                        f"<td>{layer['entropy_bits']:.3f}</td><td>{layer['sink']:.3f}</td>"
                        f"<td>{layer['distance']:.2f}</td></tr>")
    if not rows:
        return ""
    tokens = next(e["attention"]["tokens"] for e in results["variants"].values()
                  if e.get("attention") and "tokens" in e["attention"])
    head = "".join(f"<th>{h}</th>" for h in ("variant", "layer", "entropy (bits)",
                                              "sink mass", "distance (tokens)"))
    return f"""<h2>Attention on held-out text</h2>
<table class="attention"><thead><tr>{head}</tr></thead><tbody>
{chr(10).join(rows)}
</tbody></table>
<p>The viewer's summaries over the first {tokens} held-out tokens (whole windows of the
context), every head and every query row but the first (which sees only itself): the
entropy of a row's weights, the mass on the first token of the window (an attention sink)
and the mean distance from the query to the keys it attends, averaged over the seeds. A
differential layer is summarized over its two softmax maps per head; their difference is no
distribution.</p>"""


def unigram_line(results: dict) -> str:
    h = results.get("unigram_entropy")
    if h is None:
        return ""
    return (f'<p class="unigram">Unigram entropy of the held-out text: {h:.4f} nats per token '
            "(the loss of a model that reads no context; the training text's frequencies, "
            "add-one smoothed).</p>")


def page(results: dict, out: Path) -> str:
    metric, lower = results["metric"], results["lower_is_better"]
    series = {name: bands(out, e) for name, e in results["variants"].items()}
    head = ["variant", f"{metric} mean", "std", "seeds", f"vs {results['baseline']}",
            "95% interval", "verdict", "speed", "peak memory", "parameters"]
    rows = "\n".join(row(n, e, lower) for n, e in results["variants"].items())
    better = "lower" if lower else "higher"
    status = "" if results["complete"] else "<p><strong>Not every run has finished.</strong></p>"
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"/><title>qkv lab: {escape(results['lab'])}</title>
<style>{STYLE}</style></head><body>
<h1>qkv lab: {escape(results['lab'])}</h1>
<p>Task {escape(results['task'])}, preset {escape(results['preset'])}, seeds
{escape(', '.join(map(str, results['seeds'])))}; baseline {escape(results['baseline'])}.
Held-out {escape(metric)}: {better} is better.</p>{status}
<h2>Training loss</h2>
{svg(series)}
<h2>Held-out {escape(metric)}</h2>
<table><thead><tr>{"".join(f"<th>{escape(h)}</th>" for h in head)}</tr></thead>
<tbody>
{rows}
</tbody></table>
{unigram_line(results)}
<p>The interval is the {escape(results['interval'])}. A difference whose interval holds 0
is <em>within noise</em> (greyed): these seeds do not tell it from no difference. Speed is
the median training rate of each run, averaged over seeds; peak memory the highest over
seeds.</p>
{attention_table(results)}
</body></html>
"""


def write(results: dict, out: Path) -> Path:
    return write_text_atomic(out / "report.html", page(results, out))
