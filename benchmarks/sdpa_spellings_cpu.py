"""SDPA's own spellings through ``qkv.attention`` against SDPA itself, side by side in one run.

The masks an SDPA user passes (an additive float bias, a bool mask, the causal triangle
written out as 0/-inf, ``is_causal``), forward and forward+backward, with the engine qkv
picked, the time ratio SDPA/qkv (> 1: qkv faster) and the largest difference of the outputs.
Rounds alternate between the two; the fastest round of each is kept.

    python benchmarks/sdpa_spellings_cpu.py                # N = 1024 and 4096
    python benchmarks/sdpa_spellings_cpu.py --n 2048 --repeat 5

The figures also go to benchmarks/results/sdpa_spellings_cpu-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import functools
import platform
import time

import torch
import torch.nn.functional as F

import qkv
from qkv import engines
from qkv.core.problem import build_problem
from qkv.engines.api import _spelled_mask
from results import write_results  # beside this script

B, H, D = 1, 8, 64


def masks(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    upper = torch.ones(n, n, dtype=torch.bool).triu(1)
    return {
        "float bias (1, H, N, N)": {"attn_mask": torch.randn(1, H, n, n, generator=g) * 0.5},
        "float 0/-inf causal": {"attn_mask": torch.zeros(n, n).masked_fill(upper,
                                                                          float("-inf"))},
        "bool random (N, N)": {"attn_mask": torch.rand(n, n, generator=g) > 0.3},
        "is_causal": {"is_causal": True},
    }


def timed(fn, backward: bool) -> float:
    start = time.perf_counter()
    out = fn()
    if backward:
        out.sum().backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, B={B} H={H} D={D} float32")
    print("| N | mask | engine | pass | qkv ms | SDPA ms | SDPA/qkv | max diff |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for n in args.n:
        for name, kwargs in masks(n).items():
            for backward in (False, True):
                g = torch.Generator().manual_seed(1)
                q, k, v = (torch.randn(B, H, n, D, generator=g).requires_grad_(backward)
                           for _ in range(3))
                mask, mod = _spelled_mask(q, k, kwargs.get("attn_mask"), None, None,
                                          kwargs.get("is_causal", False), None, None)
                engine = engines.plan(build_problem(q, k, v, mask=mask, score_mod=mod)).engine
                calls = [functools.partial(fn, q, k, v, **kwargs)
                         for fn in (qkv.attention, F.scaled_dot_product_attention)]
                times = [[], []]
                for _ in range(args.repeat):
                    for i, call in enumerate(calls):
                        times[i].append(timed(call, backward))
                with torch.no_grad():
                    diff = (calls[0]() - calls[1]()).abs().max()
                a, b = min(times[0]) * 1e3, min(times[1]) * 1e3
                print(f"| {n} | {name} | {engine} | {'fwd+bwd' if backward else 'fwd'} | "
                      f"{a:.1f} | {b:.1f} | {b / a:.2f} | {float(diff):.1e} |", flush=True)
                rows.append({"n": n, "mask": name, "engine": engine,
                             "pass": "fwd+bwd" if backward else "fwd", "qkv_ms": round(a, 3),
                             "sdpa_ms": round(b, 3), "sdpa_over_qkv": round(b / a, 3),
                             "max_diff": float(diff)})
    write_results("sdpa_spellings_cpu", rows, B=B, H=H, D=D, dtype="float32",
                  repeat=args.repeat)


if __name__ == "__main__":
    main()
