"""``qkv lab FILE.toml -o DIR``: train every variant for every seed, then write
``DIR/results.json`` and ``DIR/report.html`` and print the table.

    qkv lab examples/lab/extensions.toml -o labs/extensions
    qkv lab my.toml -o labs/mine --jobs 2 --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import labfile, report, results, runner


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("lab_file", metavar="FILE.toml", help="the lab: [lab] and [variants.NAME]")
    p.add_argument("-o", "--output", required=True, metavar="DIR",
                   help="where the runs, results.json and report.html go; running again "
                        "continues what is there")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="runs at a time (default: one per free core; 1 trains in this process)")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise ValueError(f"--jobs: expected a whole number >= 1, got {args.jobs}")
    lab = labfile.read(args.lab_file)
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"-o {str(out)!r} is a file; expected a directory")
    runs = runner.plan_runs(lab, out)  # every run checked before the first starts
    interrupted = None
    try:
        failures = runner.run_all(lab, runs, out, args.jobs, args.threads, args.quiet)
    except runner.LabInterrupted as e:
        failures, interrupted = {}, e
    summary = results.summarize(lab, runs, failures, out)
    results.write(summary, out)
    report.write(summary, out)
    print(results.table(summary))
    print(f"wrote {out / 'results.json'} and {out / 'report.html'}")
    if interrupted is not None:
        done = sum(r.finished() for r in runs)
        print(f"qkv: lab stopped with {done}/{len(runs)} runs done; run the same command "
              "again to continue", file=sys.stderr)
        return 130
    return 1 if failures else 0
