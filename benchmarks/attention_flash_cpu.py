"""The flash CPU engine against torch's SDPA, inference forward, side by side in one run.

For each shape, qkv's flash engine three ways: float32 inputs with float32 products (causal
only: plain float32 attention is SDPA's), float32 inputs with ``fp32_precision="bf16"`` (bf16
products), and bf16 inputs. Against them, SDPA on
the same float32 and bf16 inputs. The cases alternate within each round (the machines are
shared and noisy), and each keeps its fastest round. The ratios are SDPA's time over qkv's at
the same input dtype (> 1: qkv is faster). In brackets, each output's largest difference
from float64 on the float32 inputs.

    python benchmarks/attention_flash_cpu.py                  # the default shapes, 10 rounds
    python benchmarks/attention_flash_cpu.py --rounds 20 --n 1024 4096

The figures also go to benchmarks/results/attention_flash_cpu-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import qkv
from qkv.engines.cpu import cpu_flash
from qkv.engines.cpu.build import cpuinfo_line
from results import write_results  # beside this script

COLUMNS = ("qkv fp32", "qkv fp32, bf16 products", "qkv bf16", "SDPA fp32", "SDPA bf16")


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def report(heads: int, kv_heads: int, n: int, causal: bool, rounds: int) -> tuple[str, dict]:
    """The markdown row of one shape, and the same figures as a dict (ms, errors, ratios)."""
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, heads, n, 64, generator=g)
    k, v = (torch.randn(1, kv_heads, n, 64, generator=g) for _ in range(2))
    bf = [t.bfloat16() for t in (q, k, v)]
    mask = qkv.causal() if causal else None
    gqa = {"enable_gqa": True} if heads != kv_heads else {}
    cases = dict(zip(COLUMNS, (
        lambda: qkv.attention(q, k, v, mask=mask, backend="flash"),
        lambda: qkv.attention(q, k, v, mask=mask, fp32_precision="bf16", backend="flash"),
        lambda: qkv.attention(*bf, mask=mask, backend="flash"),
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa),
        lambda: F.scaled_dot_product_attention(*bf, is_causal=causal, **gqa),
    ), strict=True))
    if not causal:  # plain float32 attention is SDPA's (no faster in the flash engine)
        del cases["qkv fp32"]
    best = dict.fromkeys(cases, float("inf"))
    with torch.no_grad():
        exact = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="sdpa")
        error = {name: (fn().double() - exact).abs().max().item() for name, fn in cases.items()}
        for turn in range(rounds):
            for name in cases if turn % 2 == 0 else list(cases)[::-1]:
                best[name] = min(best[name], _time(cases[name]))
    ms = " | ".join(f"{best[c] * 1e3:.2f} ({error[c]:.1e})" if c in cases else "-"
                    for c in COLUMNS)
    sdpa = best["SDPA fp32"]
    fp32 = f"{sdpa / best['qkv fp32']:.2f}x" if causal else "-"
    line = (f"| {heads}/{kv_heads} | {n} | {'causal' if causal else 'none'} | {ms} | {fp32} | "
            f"{sdpa / best['qkv fp32, bf16 products']:.2f}x | "
            f"{best['SDPA bf16'] / best['qkv bf16']:.2f}x |")
    row = {"heads": heads, "kv_heads": kv_heads, "n": n, "causal": causal}
    for c in cases:
        key = c.lower().replace(",", "").replace(" ", "_")
        row[f"{key}_ms"] = round(best[c] * 1e3, 3)
        row[f"{key}_error"] = error[c]
    row["sdpa_fp32_over_qkv_fp32"] = round(sdpa / best["qkv fp32"], 3) if causal else None
    row["sdpa_fp32_over_qkv_bf16_products"] = round(sdpa / best["qkv fp32, bf16 products"], 3)
    row["sdpa_bf16_over_qkv_bf16"] = round(best["SDPA bf16"] / best["qkv bf16"], 3)
    return line, row


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    if not (cpu_flash.available("fp32") and cpu_flash.available("bf16")):
        raise SystemExit("the flash engine needs an AMD CPU with AVX-512 and AVX512-BF16, and a "
                         "C compiler")
    cpu = cpuinfo_line("model name").partition(":")[2].strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu} "
          f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; B=1, D=64, fastest of {args.rounds} alternating rounds")
    print("# ms (largest error from float64 on the float32 inputs)\n")
    print("| heads / KV heads | N | mask | " + " | ".join(COLUMNS) + " | SDPA fp32 / qkv fp32 "
          "| SDPA fp32 / qkv bf16 products | SDPA bf16 / qkv bf16 |")
    print("|---" * 11 + "|")
    rows = []
    for n in args.n:
        for heads, kv_heads, causal in ((8, 8, False), (8, 8, True), (9, 3, True)):
            line, row = report(heads, kv_heads, n, causal, args.rounds)
            print(line, flush=True)
            rows.append(row)
    write_results("attention_flash_cpu", rows, B=1, D=64, rounds=args.rounds)


if __name__ == "__main__":
    main()
