"""What hooks cost on SmolLM2 (CPU): reading one layer's pattern, a head ablation and a
hook_z patch, each against a plain forward, side by side in one run.

Every case is one forward of SmolLM2-135M over N tokens with the logits of the last
position (``last_only=True``, what a patching metric reads), in float32 with no gradients:

- plain: ``model(idx, last_only=True)``;
- pattern: ``run_with_cache`` of ``blocks.{layer}.attn.hook_pattern`` for --heads (the
  layer runs its fused engine and forms those heads' weights from its log-sum-exp);
- ablate: inside ``qkv.interp.ablate(model, heads=[(layer, 0)])``;
- patch z: one head's ``hook_z`` replaced by a stored clean run's (one entry of
  ``qkv.interp.patch(what="z")``).

Times are the best of --rounds, the cases alternating so they see the same machine load;
peak memory is each case's resident high-water mark above the level before it, in a fresh
process after a warm-up call. The targets: pattern ≤ 1.5× plain in time and ≤ plain + 1.2×
the pattern's own bytes in memory; ablate and patch z ≤ 1.2× plain.

    python benchmarks/interp.py                       # N = 8192, 2 threads
    python benchmarks/interp.py --n 2048 --rounds 3
    python benchmarks/interp.py --cases plain,pattern --rounds 1

The figures also go to benchmarks/results/interp-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import subprocess
import sys
import time

import torch

from results import write_results  # beside this script

CASES = ("plain", "pattern", "ablate", "patch z")


def setup(n: int, threads: int, layer: int, heads: list[int]):
    """A function per case, each running one forward."""
    from qkv import interp
    from qkv.models import load_pretrained

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, _ = load_pretrained("smollm2")
    model.eval().requires_grad_(False)
    idx = torch.randint(0, model.config.vocab_size, (1, n))
    z_name = f"blocks.{layer}.attn.hook_z"
    clean = {}

    def swap(z, hook):
        z = z.clone()
        z[:, :, 0] = clean[z_name][:, :, 0]
        return z

    def plain():
        return model(idx, last_only=True)

    def pattern():
        return model.run_with_cache(idx, names_filter=f"blocks.{layer}.attn.hook_pattern",
                                    heads=heads, last_only=True)

    def ablate():
        with interp.ablate(model, heads=[(layer, 0)]):
            return model(idx, last_only=True)

    def patch_z():
        if not clean:  # the clean run, made on the first (warm-up) call
            clean.update(model.run_with_cache(idx.roll(1, 1), names_filter=z_name,
                                              last_only=True)[1])
        return model.run_with_hooks(idx, fwd_hooks=[(z_name, swap)], last_only=True)

    return dict(zip(CASES, (plain, pattern, ablate, patch_z), strict=True))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def peak_of(case: str, args) -> None:
    """Print the peak resident bytes of one call of ``case`` above the level before it."""
    fn = setup(args.n, args.threads, args.layer, args.heads)[case]
    with torch.no_grad():
        fn()  # warm-up: kernel builds and lazy initialization stay out of the figure
        # Large allocations on mmap, so freed tensors leave the resident set; then the
        # kernel's high-water mark is reset.
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 16)
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status("VmRSS")
        fn()
        print(_status("VmHWM") - before)


def peak_in_child(case: str, args) -> float | None:
    done = subprocess.run(
        [sys.executable, __file__, "--peak-of", case, "--n", str(args.n), "--threads",
         str(args.threads), "--layer", str(args.layer),
         "--heads", ",".join(map(str, args.heads))],
        capture_output=True, text=True, check=False)
    lines = done.stdout.split()
    return float(lines[-1]) if done.returncode == 0 and lines else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--heads", type=lambda s: [int(h) for h in s.split(",")],
                        default=[0, 1, 2, 3])
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES),
                        help=f"a comma-separated subset of {', '.join(CASES)} (plain first)")
    parser.add_argument("--peak-of", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of:
        peak_of(args.peak_of, args)
        return
    cases = [c for c in CASES if c in args.cases]
    if cases[:1] != ["plain"] or len(cases) != len(args.cases):
        raise SystemExit(f"--cases must name plain and some of {', '.join(CASES)}; got "
                         f"{args.cases}")
    fns = {case: fn for case, fn in setup(args.n, args.threads, args.layer, args.heads).items()
           if case in cases}
    best = dict.fromkeys(cases, float("inf"))
    with torch.no_grad():
        for fn in fns.values():
            fn()  # warm-up: kernel builds, lazy initialization, the clean run
        for _ in range(args.rounds):
            for case, fn in fns.items():
                start = time.perf_counter()
                fn()
                best[case] = min(best[case], time.perf_counter() - start)
    peaks = {case: None if args.no_memory else peak_in_child(case, args) for case in cases}
    pattern_bytes = len(args.heads) * args.n * args.n * 4
    load = os.getloadavg()[0]
    print(f"SmolLM2-135M, N={args.n}, {args.threads} threads, layer {args.layer}, heads "
          f"{args.heads}; load average {load:.2f}; pattern {pattern_bytes / 2**20:.0f} MiB")
    print(f"{'case':10} {'s':>8} {'× plain':>8} {'peak MiB':>9} {'extra / pattern':>16}")
    rows = []
    for case in cases:
        ratio = best[case] / best["plain"]
        peak, base = peaks[case], peaks["plain"]
        extra = None if peak is None or base is None else (peak - base) / pattern_bytes
        print(f"{case:10} {best[case]:8.2f} {ratio:8.2f} "
              f"{'-' if peak is None else f'{peak / 2**20:9.0f}':>9} "
              f"{'-' if extra is None else f'{extra:16.2f}':>16}")
        rows.append({"case": case, "n": args.n, "s": round(best[case], 3),
                     "x_plain": round(ratio, 3),
                     "peak_mib": None if peak is None else round(peak / 2**20),
                     "extra_over_pattern_bytes": None if extra is None else round(extra, 3)})
    write_results("interp", rows, threads=args.threads, layer=args.layer, heads=args.heads,
                  rounds=args.rounds, load_average=round(load, 2),
                  pattern_mib=round(pattern_bytes / 2**20))


if __name__ == "__main__":
    main()
