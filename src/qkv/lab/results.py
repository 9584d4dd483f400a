"""``results.json``: each variant's runs, the mean and spread of its metric over the seeds,
and its difference from the baseline with a 95 % Welch interval; the text table."""

from __future__ import annotations

import json
from pathlib import Path

from ..data.atomic import write_json_atomic
from . import attention, stats, worker
from .labfile import Lab
from .runner import Run

# The held-out number each task is compared on, and whether lower is better.
METRICS = {"lm": ("loss", True), "translate": ("chrf", False), "vit": ("accuracy", False)}


def run_entry(r: Run, out: Path, metric: str) -> dict:
    record = json.loads((r.run_dir / worker.MARK).read_text())
    return {"seed": r.seed, "run_dir": str(r.run_dir.relative_to(out)),
            metric: record["result"][metric], "throughput": record["throughput"],
            "peak_memory_bytes": record["peak_memory_bytes"],
            "parameters": record["parameters"], "steps": record["steps"],
            "seconds": record["seconds"], "unit": record["unit"]}


def attention_entry(done: list[Run]) -> dict | None:
    """The variant's attention summaries on held-out text, per layer, averaged over its
    finished seeds; a run whose summaries fail gives its error instead."""
    if not done:
        return None
    try:
        found = [attention.run_summary(r.run_dir) for r in done]
    except Exception as e:  # noqa: BLE001 - the table stands without the summaries
        return {"error": str(e).splitlines()[0] if str(e) else type(e).__name__}
    return {"layers": attention.mean_over_seeds(found), "seeds": len(found),
            "tokens": found[0]["tokens"], "unigram_entropy": found[0]["unigram_entropy"]}


def summarize(lab: Lab, runs: list[Run], failures: dict[str, str], out: Path) -> dict:
    """The results of the finished runs; a run that failed is listed with its error."""
    metric, lower = METRICS[lab.task]
    variants = {}
    for v in lab.variants:
        mine = [r for r in runs if r.variant == v]
        done = [run_entry(r, out, metric) for r in mine if r.finished()]
        values = [d[metric] for d in done]
        mean, std = stats.mean_std(values) if values else (None, None)
        variants[v.name] = {
            "overrides": list(v.overrides), "runs": done,
            "failed": [{"seed": r.seed, "error": failures[r.name]} for r in mine
                       if r.name in failures],
            "n": len(values), "mean": mean, "std": std,
        }
        if lab.task == "lm":
            variants[v.name]["attention"] = attention_entry([r for r in mine if r.finished()])
    base = lab.variants[0].name
    unigram = next((e["attention"]["unigram_entropy"] for e in variants.values()
                    if e.get("attention") and e["attention"].get("unigram_entropy")), None)
    base_values = [d[metric] for d in variants[base]["runs"]]
    for name, entry in variants.items():
        values = [d[metric] for d in entry["runs"]]
        entry["vs_baseline"] = (stats.welch(values, base_values)
                                if name != base and values and base_values else None)
    return {"lab": str(lab.path), "task": lab.task, "preset": lab.preset,
            "seeds": list(lab.seeds), "metric": metric, "lower_is_better": lower,
            "baseline": base, "interval": stats.INTERVAL,
            "complete": all(r.finished() for r in runs), "unigram_entropy": unigram,
            "variants": variants}


def write(results: dict, out: Path) -> Path:
    """``out/results.json``, atomically: a reader never sees half a file."""
    return write_json_atomic(out / "results.json", results)


def verdict(entry: dict, lower: bool) -> str:
    vs = entry["vs_baseline"]
    if vs is None:
        return "baseline" if entry["n"] else ""
    if vs["within_noise"] is None:
        return "one seed: no interval"
    if vs["within_noise"]:
        return "within noise"
    return "better" if (vs["difference"] < 0) == lower else "worse"


def fmt_rate(entry: dict) -> str:
    rates = [d["throughput"] for d in entry["runs"] if d["throughput"]]
    if not rates:
        return ""
    rate = sum(rates) / len(rates)
    shown = f"{rate / 1000:.1f}k" if rate >= 1000 else f"{rate:.0f}"
    return f"{shown} {entry['runs'][0]['unit']}/s"


def fmt_memory(entry: dict) -> str:
    peaks = [d["peak_memory_bytes"] for d in entry["runs"]]
    return f"{max(peaks) / 1e9:.2f} GB" if peaks else ""


def table(results: dict) -> str:
    """One line per variant: the metric's mean ± std (n), the difference from the baseline
    and its interval, the verdict, throughput and peak memory; then each failure."""
    metric, lower = results["metric"], results["lower_is_better"]
    rows = [("variant", f"{metric} mean ± std (n)", f"vs {results['baseline']} [95% Welch]",
             "", "speed", "peak memory")]
    failed = []
    for name, e in results["variants"].items():
        score = (f"{e['mean']:.4f} ± {e['std']:.4f} ({e['n']})" if e["std"] is not None
                 else f"{e['mean']:.4f} ({e['n']})" if e["n"] else "no finished run")
        vs = e["vs_baseline"]
        diff = ""
        if vs is not None:
            diff = f"{vs['difference']:+.4f}"
            if vs["interval"] is not None:
                diff += f" [{vs['interval'][0]:+.4f}, {vs['interval'][1]:+.4f}]"
        rows.append((name, score, diff, verdict(e, lower), fmt_rate(e), fmt_memory(e)))
        failed += [f"  {name}-s{f['seed']} failed: {f['error']}" for f in e["failed"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    return "\n".join(lines + failed)
