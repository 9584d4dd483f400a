"""CPU linear products of a few rows, side by side: torch's ``F.linear`` (MKL on x86), oneDNN
(``qkv.nn.linear.onednn_linear``) and qkv's few-row loop (``qkv.engines.cpu.few_rows``), on
SmolLM2-135M's weight shapes, with the bandwidth each reads its weight at. With ``--dtype
bf16`` the weights are bf16 and x is float32, as in ``qkv.nn.packed``'s layers: torch's bf16
product (x rounded to bf16), oneDNN's on its pre-packed weight, and the loop's bf16 product.

Each product cycles through enough copies of its weight (--weight-mib in all) that none is in
cache, as in decoding, where every layer's weight is read once per token. Rounds alternate the
three, and the table gives each one's fastest round and its time as a multiple of F.linear's.

    python benchmarks/linear_cpu.py
    python benchmarks/linear_cpu.py --rows 1,8,16,32 --threads 1
    python benchmarks/linear_cpu.py --dtype bf16 --rows 1,4,8,16

The figures also go to benchmarks/results/linear_cpu-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from results import write_results  # beside this script

# (in, out) of SmolLM2-135M's layers: q and o, k and v, gate and up, down, the head.
SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152))


def _per_call(product, x, weights) -> float:
    """Seconds per product of x by each weight in turn."""
    start = time.perf_counter()
    for weight in weights:
        product(x, weight)
    return (time.perf_counter() - start) / len(weights)


def _systems(dtype: str) -> dict:
    """name -> (product(x, weight), prepare(weight) -> the weight it reads)."""
    from qkv.engines.cpu import few_rows
    from qkv.nn.linear import onednn_linear
    from qkv.nn.packed import _onednn_ok

    def same(weight):
        return weight

    if dtype == "float32":
        systems = {"F.linear": (F.linear, same), "few-row loop": (few_rows.few_rows_linear, same)}
        if torch.backends.mkldnn.is_available():
            systems["oneDNN"] = (onednn_linear, same)
        return systems
    systems = {"F.linear": (lambda x, w: F.linear(x.to(torch.bfloat16), w).float(), same),
               "few-row loop": (few_rows.few_rows_linear_bf16, same)}
    if _onednn_ok(torch.device("cpu")):
        systems["oneDNN packed"] = (
            lambda x, w: onednn_linear(x.to(torch.bfloat16), w).float(),
            lambda w: torch.ops.mkldnn._reorder_linear_weight(w, 1))
    return systems


def main(argv: list[str] | None = None) -> int:
    from qkv.engines.cpu import few_rows

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32", help="row counts, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--weight-mib", type=int, default=256,
                        help="bytes of weight copies each product cycles through")
    parser.add_argument("--dtype", choices=("float32", "bf16"), default="float32",
                        help="the weights' dtype (x is float32 either way)")
    args = parser.parse_args(argv)
    try:
        row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows must be integers separated by commas; got {args.rows!r}")
    if min(row_counts) < 1 or args.threads < 1 or args.rounds < 1 or args.weight_mib < 1:
        parser.error("--rows, --threads, --rounds and --weight-mib must be positive")
    if not few_rows.available():
        print("qkv's few-row loop is not built here (QKV_FEW_ROWS_LINEAR=0, or no C compiler)",
              file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    systems = _systems(args.dtype)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    size = dtype.itemsize
    print(f"{args.dtype} weights, {args.threads} threads, fastest of {args.rounds} rounds; "
          "time in us, read GB/s, and the multiple of F.linear's time")
    print("| in -> out | rows | " + " | ".join(systems) + " |")
    print("|---|---|" + "---|" * len(systems))
    rows_out = []
    generator = torch.Generator().manual_seed(0)
    for n_in, n_out in SHAPES:
        copies = max(2, (args.weight_mib << 20) // (n_in * n_out * size))
        plain = [torch.randn(n_out, n_in, generator=generator).to(dtype) for _ in range(copies)]
        weights = {name: [prepare(w) for w in plain] for name, (_, prepare) in systems.items()}
        for rows in row_counts:
            x = torch.randn(rows, n_in, generator=generator)
            best = dict.fromkeys(systems, float("inf"))
            for round_ in range(args.rounds + 1):  # round 0 warms up
                for name, (product, _) in systems.items():
                    seconds = _per_call(product, x, weights[name])
                    if round_:
                        best[name] = min(best[name], seconds)
            gigabytes = n_in * n_out * size / 1e9
            cells = [f"{best[n] * 1e6:.0f} ({gigabytes / best[n]:.1f}, "
                     f"{best[n] / best['F.linear']:.2f}x)" for n in systems]
            print(f"| {n_in} -> {n_out} | {rows} | " + " | ".join(cells) + " |", flush=True)
            rows_out += [{"variant": name, "in": n_in, "out": n_out, "rows": rows,
                          "ms": best[name] * 1e3, "gb_per_s": gigabytes / best[name],
                          "vs_f_linear": best[name] / best["F.linear"]} for name in systems]
    write_results("linear_cpu", rows_out, threads=args.threads, rounds=args.rounds,
                  dtype=args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
