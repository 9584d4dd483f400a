"""A finished ``qkv lab`` folder's table as benchmark results: one flat row per variant
(the held-out metric's mean and spread, the difference from the baseline with its 95 % Welch
interval, whether it is within noise, speed, peak memory, parameters, training seconds),
into benchmarks/results/lab_<name>-<date>-<machine>.json.

    python benchmarks/lab_results.py /tmp/lab-ext --name extensions --wall-s 1500 \\
        --command "qkv lab examples/lab/extensions.toml -o /tmp/lab-ext --jobs 2 --threads 1"

--wall-s is the lab command's measured wall-clock time and --load what uptime showed; the
results.json holds neither.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from results import write_results  # beside this script


def rows(results: dict) -> list[dict]:
    metric, found = results["metric"], []
    for name, e in results["variants"].items():
        vs = e["vs_baseline"] or {}
        interval = vs.get("interval") or [None, None]
        runs = e["runs"]
        rates = [r["throughput"] for r in runs if r["throughput"]]
        found.append({
            "variant": name, f"{metric}_mean": e["mean"], f"{metric}_std": e["std"],
            "seeds": e["n"], "difference": vs.get("difference"), "interval_low": interval[0],
            "interval_high": interval[1], "within_noise": vs.get("within_noise"),
            "throughput": sum(rates) / len(rates) if rates else None,
            "unit_per_s": runs[0]["unit"] if runs else None,
            "peak_memory_mb": max(r["peak_memory_bytes"] for r in runs) / 1e6 if runs else None,
            "parameters": runs[0]["parameters"] if runs else None,
            "train_s_mean": sum(r["seconds"] for r in runs) / len(runs) if runs else None,
            "failed": len(e["failed"]),
        })
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("lab_dir", type=Path, help="the -o DIR of a finished qkv lab")
    p.add_argument("--name", required=True, help="the results file's name: lab_NAME-...")
    p.add_argument("--command", required=True, help="the qkv lab command that ran")
    p.add_argument("--wall-s", type=float, required=True, help="its measured wall time (s)")
    p.add_argument("--load", default="", help="the load average during the run")
    args = p.parse_args()
    results = json.loads((args.lab_dir / "results.json").read_text())
    write_results(f"lab_{args.name}", rows(results), lab_command=args.command,
                  wall_s=args.wall_s, load=args.load, lab=results["lab"],
                  seeds=results["seeds"], baseline=results["baseline"],
                  metric=results["metric"], interval=results["interval"],
                  unigram_entropy=results.get("unigram_entropy"), threads=1)


if __name__ == "__main__":
    main()
