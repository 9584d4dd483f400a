"""Where a decoded token's time goes on CPU: SmolLM2-135M-Instruct (float32, batch 1) in qkv.

Two reports, side by side in one run:

- ``token``: greedy decoding of --new tokens after a --prompt-len prompt, with a clock around
  each call of the parts below, so the table gives each part's milliseconds a token and
  microseconds a call (the clocks add about a microsecond a call). The first token's prefill
  is measured alone and taken away.
- ``cold``: the same small operations alone in a loop, hot, and again right after reading
  --sweep-mb of memory, as decoding does between them: each token streams its weights
  (513 MiB in float32) through the caches, which evicts torch's and Python's code and data.

    python benchmarks/decode_profile_cpu.py
    python benchmarks/decode_profile_cpu.py --rounds 5 --new 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.nn.functional as F

from results import write_results  # beside this script


def token_parts() -> dict[str, list[tuple[object, str]]]:
    """part -> the (owner, attribute) pairs timed; a call inside another of the same part
    (a layer's own call from ``shared_input``) counts once, as the outer one."""
    import qkv.nn.attention
    import qkv.nn.feedforward
    import qkv.nn.linear
    import qkv.nn.norms
    import qkv.nn.positions

    return {"products (qkv.nn.Linear)": [(qkv.nn.linear.Linear, "forward"),
                                         (qkv.nn.attention, "shared_input"),
                                         (qkv.nn.feedforward, "shared_input")],
            "attention calls (qkv.attention)": [(qkv.nn.attention, "attention")],
            "RMSNorm": [(qkv.nn.norms.RMSNorm, "forward")],
            "rotary positions": [(qkv.nn.positions.RotaryEmbedding, "forward")]}


def clocked(parts, spent: Counter, calls: Counter) -> None:
    depth = Counter()
    for name, sites in parts.items():
        for owner, attribute in sites:
            original = getattr(owner, attribute)

            def timed(*args, _original=original, _name=name, **kwargs):
                depth[_name] += 1
                start = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    depth[_name] -= 1
                    if not depth[_name]:
                        spent[_name] += time.perf_counter() - start
                        calls[_name] += 1

            setattr(owner, attribute, timed)


def token_report(args) -> list[dict]:
    from qkv.models import load_pretrained

    model, _ = load_pretrained("smollm2")
    ids = torch.randint(100, 1000, (1, args.prompt_len),
                        generator=torch.Generator().manual_seed(0))
    spent, calls = Counter(), Counter()
    clocked(token_parts(), spent, calls)
    model.generate(ids, 4, temperature=0)  # builds and loads what the first call needs
    per_round = []
    for _ in range(args.rounds):
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        model.generate(ids, 1, temperature=0)
        prefill, prefill_spent, prefill_calls = time.perf_counter() - start, +spent, +calls
        spent.clear()
        calls.clear()
        start = time.perf_counter()
        model.generate(ids, args.new + 1, temperature=0)
        whole = time.perf_counter() - start - prefill
        per_round.append({"token": whole / args.new} | {
            name: ((spent[name] - prefill_spent[name]) / args.new,
                   (calls[name] - prefill_calls[name]) / args.new) for name in spent})
    rows = [{"report": "token", "part": "whole token",
             "ms_per_token": statistics.median(r["token"] for r in per_round) * 1e3}]
    for name in token_parts():
        ms = statistics.median(r[name][0] for r in per_round) * 1e3
        count = per_round[0][name][1]
        rows.append({"report": "token", "part": name, "ms_per_token": ms,
                     "calls_per_token": count, "us_per_call": ms * 1e3 / count})
    return rows


def cold_report(args) -> list[dict]:
    sweep = torch.randn(args.sweep_mb * 2**20 // 4)
    x, w = torch.randn(1, 1, 576), torch.rand(576)
    ops = {"rms_norm, one row of 576": lambda: F.rms_norm(x, (576,), w, 1e-5),
           "layer_norm, one row of 576": lambda: F.layer_norm(x, (576,), w, None, 1e-5),
           "x * w": lambda: x * w,
           "new_empty": lambda: x.new_empty(1, 1, 576)}
    rows = []
    for name, op in ops.items():
        for _ in range(200):
            op()
        hot, cold = [], []
        for _ in range(args.cold_calls):
            start = time.perf_counter()
            op()
            hot.append(time.perf_counter() - start)
            sweep.sum()
            start = time.perf_counter()
            op()
            cold.append(time.perf_counter() - start)
        rows.append({"report": "cold", "op": name, "hot_us": statistics.median(hot) * 1e6,
                     "after_sweep_us": statistics.median(cold) * 1e6})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new", type=int, default=32, help="tokens decoded each round")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sweep-mb", type=int, default=64,
                        help="memory read between the cold calls (MiB)")
    parser.add_argument("--cold-calls", type=int, default=150)
    args = parser.parse_args(argv)
    for name in ("new", "prompt_len", "rounds", "threads", "sweep_mb", "cold_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1; got "
                         f"{getattr(args, name)}")
    torch.set_num_threads(args.threads)
    rows = token_report(args)
    print(f"SmolLM2 fp32, batch 1, {args.new} tokens after {args.prompt_len}, "
          f"{args.threads} threads, median of {args.rounds} rounds")
    for row in rows:
        extra = (f"  {row['calls_per_token']:.0f} calls, {row['us_per_call']:.1f} us each"
                 if "us_per_call" in row else "")
        print(f"  {row['part']:34s} {row['ms_per_token']:7.2f} ms a token{extra}")
    cold = cold_report(args)
    print(f"one small operation, hot and after reading {args.sweep_mb} MiB (median us)")
    for row in cold:
        print(f"  {row['op']:34s} {row['hot_us']:7.1f} hot  {row['after_sweep_us']:7.1f} after"
              f"  ({row['after_sweep_us'] / row['hot_us']:.1f}x)")
    write_results("decode_profile_cpu", rows + cold, threads=args.threads, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
