"""This tree's attention variants against another commit's, forward+backward, alternating.

A change to an engine must not slow the variants it leaves alone. This script checks out
COMMIT's files into a temporary folder (``git archive``: the repository is not touched), then
runs rounds of two fresh processes, one per tree, alternating which goes first, so drifting
load hits both alike. Each process times every variant of its own
``benchmarks/attention_cpu.py`` (``case_kwargs``: the same names in both trees) through
``qkv.attention``'s dispatch, as a user's call runs. Setup: B=1, H=8, D=64, float32.

    python benchmarks/against_commit.py a43b3d7 --n 4096 --rounds 5

Printed per variant: this tree's and COMMIT's best time, and the median over rounds of the
per-round ratio COMMIT / this tree (> 1 means this tree is faster). Round 0 builds both
trees' C kernels and is not counted. The figures go to benchmarks/results (``results.py``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

from results import write_results  # beside this script

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
DEFAULT_VARIANTS = ["dot", "causal", "alibi", "window", "softcap", "segments", "cosine", "l2",
                    "l1", "mahalanobis", "graph"]

# Runs in each tree: its own package, its own variant table, one warm-up and the best of
# --repeat timed runs per variant. Prints {variant: seconds} as JSON on its last line.
CHILD = """
import functools, json, sys, time
sys.path[:0] = [sys.argv[1] + "/src", sys.argv[1] + "/benchmarks"]
import qkv, attention_cpu as bench
n, repeat, names = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
times = {}
for name in names:
    run = bench.forward_backward(functools.partial(qkv.attention, **bench.case_kwargs(name, n)), n)
    times[name] = bench.best_time(run, repeat)
print(json.dumps(times))
"""


def child_times(tree: pathlib.Path, n: int, repeat: int, variants: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(n), str(repeat),
                           *variants], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def export(commit: str, into: pathlib.Path) -> str:
    """COMMIT's files into ``into``; returns its short hash."""
    short = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", commit],
                           capture_output=True, text=True, check=False)
    if short.returncode != 0:
        sys.exit(f"commit: {commit!r} is not a commit of {ROOT} ({short.stderr.strip()})")
    archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", commit],
                               stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", str(into)], stdin=archive.stdout, check=True)
    if archive.wait() != 0:
        sys.exit(f"git archive {commit} failed")
    return short.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("commit", help="the commit to compare with (e.g. the one before a change)")
    parser.add_argument("--n", type=int, default=4096, help="sequence length")
    parser.add_argument("--rounds", type=int, default=5,
                        help="counted rounds (each: two processes)")
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per variant per process")
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    args = parser.parse_args()
    if args.rounds < 1 or args.repeat < 1 or args.n < 1:
        parser.error("--n, --rounds and --repeat must be positive")
    with tempfile.TemporaryDirectory(prefix="qkv-against-") as tmp:
        old = pathlib.Path(tmp)
        short = export(args.commit, old)
        trees = {"this tree": ROOT, short: old}
        rounds = []
        for r in range(args.rounds + 1):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            got = {label: child_times(trees[label], args.n, args.repeat, args.variants)
                   for label in order}
            if r > 0:
                rounds.append(got)
            print(f"round {r}{' (build, not counted)' if r == 0 else ''} done", flush=True)
    print(f"\nN={args.n} forward+backward, B=1 H=8 D=64 float32; {args.rounds} alternating "
          f"rounds, best of {args.repeat} per process; ratio = {short} / this tree")
    print(f"  {'variant':14s} {'this tree':>10s} {short:>10s}  median ratio  range")
    rows = []
    for name in args.variants:
        new = [r["this tree"][name] for r in rounds]
        base = [r[short][name] for r in rounds]
        ratios = [b / a for a, b in zip(new, base, strict=True)]
        med = statistics.median(ratios)
        print(f"  {name:14s} {min(new) * 1e3:8.0f} ms {min(base) * 1e3:8.0f} ms  {med:11.3f}  "
              f"{min(ratios):.2f}-{max(ratios):.2f}", flush=True)
        rows.append({"report": "against_commit", "commit": short, "variant": name, "n": args.n,
                     "this_tree_s": round(min(new), 4), "commit_s": round(min(base), 4),
                     "median_ratio": round(med, 3), "rounds": args.rounds})
    write_results("against_commit", rows)


if __name__ == "__main__":
    main()
