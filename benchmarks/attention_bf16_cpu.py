"""The bf16 CPU engine against torch's SDPA, inference forward, side by side in one run.

For each shape: qkv's "bf16" engine on float32 inputs (``fp32_precision="bf16"``) and on bf16
inputs, against SDPA on the same float32 and bf16 inputs. The cases alternate within each
round (the machines are shared and noisy); each keeps its fastest round, and the ratios are
SDPA's time over the engine's at the same input dtype (> 1: qkv is faster). The error
column is the largest output difference from float64 on the float32 inputs.

    python benchmarks/attention_bf16_cpu.py                  # the default shapes, 10 rounds
    python benchmarks/attention_bf16_cpu.py --rounds 20 --n 1024 4096
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import qkv
from qkv.core.engines import cpu_bf16
from qkv.core.engines.native import cpuinfo_line


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def report(heads: int, kv_heads: int, n: int, causal: bool, rounds: int) -> str:
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, heads, n, 64, generator=g)
    k, v = (torch.randn(1, kv_heads, n, 64, generator=g) for _ in range(2))
    bf = [t.bfloat16() for t in (q, k, v)]
    mask = qkv.causal() if causal else None
    gqa = {"enable_gqa": True} if heads != kv_heads else {}
    cases = {
        "qkv fp32 inputs": lambda: qkv.attention(q, k, v, mask=mask, fp32_precision="bf16",
                                                 backend="bf16"),
        "qkv bf16 inputs": lambda: qkv.attention(*bf, mask=mask, backend="bf16"),
        "SDPA fp32": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa),
        "SDPA bf16": lambda: F.scaled_dot_product_attention(*bf, is_causal=causal, **gqa),
    }
    best = dict.fromkeys(cases, float("inf"))
    with torch.no_grad():
        exact = qkv.attention(q.double(), k.double(), v.double(), mask=mask, backend="sdpa")
        error = {name: (fn().double() - exact).abs().max().item() for name, fn in cases.items()}
        for turn in range(rounds):
            for name in cases if turn % 2 == 0 else list(cases)[::-1]:
                best[name] = min(best[name], _time(cases[name]))
    ms = " | ".join(f"{best[c] * 1e3:.2f} ({error[c]:.1e})" for c in cases)
    return (f"| {heads}/{kv_heads} | {n} | {'causal' if causal else 'none'} | {ms} | "
            f"{best['SDPA fp32'] / best['qkv fp32 inputs']:.2f}x | "
            f"{best['SDPA bf16'] / best['qkv bf16 inputs']:.2f}x |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--rounds", type=int, default=10)
    args = p.parse_args(argv)
    if not cpu_bf16.available():
        raise SystemExit("this CPU has no AVX512-BF16 (or there is no C compiler): no bf16 engine")
    cpu = cpuinfo_line("model name").partition(":")[2].strip()
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu} "
          f"({torch.backends.cpu.get_cpu_capability()}), {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; B=1, D=64, fastest of {args.rounds} alternating rounds")
    print("# ms (largest error from float64 on the float32 inputs)\n")
    print("| heads / KV heads | N | mask | qkv, fp32 inputs | qkv, bf16 inputs | SDPA fp32 | "
          "SDPA bf16 | SDPA fp32 / qkv | SDPA bf16 / qkv |")
    print("|---" * 9 + "|")
    for n in args.n:
        for heads, kv_heads, causal in ((8, 8, False), (8, 8, True), (9, 3, True)):
            print(report(heads, kv_heads, n, causal, args.rounds), flush=True)


if __name__ == "__main__":
    main()
