"""Host time of a user-written score modifier against qkv's own class, forward+backward, on
small problems where tracing would dominate: a user's callable is traced once per variant
and shape class (``kernelgen.memo``), as qkv's own classes are.

    python benchmarks/trace_memo_cpu.py [--n 64] [--repeat 200]

Prints the median time per call of each and their ratio (user / qkv), in alternating rounds.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import qkv


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def user_softcap(score, b, h, q_idx, kv_idx):
    return 20.0 * torch.tanh(score / 20.0)


def _step(q, k, v, score_mod) -> None:
    out = qkv.attention(q, k, v, score_mod=score_mod, mask=qkv.causal())
    out.sum().backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, args.n, 32, requires_grad=True) for _ in range(3))
    mods = {"qkv.softcap(20)": qkv.softcap(20.0), "user softcap": user_softcap}
    times: dict[str, list[float]] = {name: [] for name in mods}
    for mod in mods.values():  # warm: compile the C loops once
        for _ in range(3):
            _step(q, k, v, mod)
    for _ in range(args.repeat):
        for name, mod in mods.items():
            start = time.perf_counter()
            _step(q, k, v, mod)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(f"{_cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"B=1 H=4 N={args.n} D=32 float32, causal, forward+backward")
    for name, us in medians.items():
        print(f"  {name:16s} {us:9.1f} us")
    print(f"  user / qkv: {medians['user softcap'] / medians['qkv.softcap(20)']:.2f}")


if __name__ == "__main__":
    main()
