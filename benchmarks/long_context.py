"""Long-context attention on CPU: forward+backward time and peak memory against N.

Kinds: softmax through ``qkv.attention`` (full and causal; the dispatcher picks the engine,
shown in the table), causal softmax forced onto qkv's fused engine, sliding window and
Longformer/BigBird-style sparse masks (the fused engine; cost follows the fraction of
non-empty tiles, shown), linear attention with both feature maps, and chunkwise retention.

Each kind runs in a fresh subprocess with N increasing; peak memory is the growth of the
process's peak resident set (ru_maxrss) over its resident set just before the run. A case
is skipped when the previous N predicts it would take longer than --case-budget seconds.

    python benchmarks/long_context.py                      # N = 1k ... 64k, a few minutes
    python benchmarks/long_context.py --case-budget 600    # let the O(N²) rows reach 64k
    python benchmarks/long_context.py --max-n 131072 --kinds linear_elu retention
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time

QUADRATIC = {"softmax_full", "softmax_causal", "causal_fused"}
KINDS = [
    "softmax_full", "softmax_causal", "causal_fused", "sliding_window", "longformer", "bigbird",
    "linear_elu", "linear_favor", "retention",
]


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc), so the next baseline is not inflated."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_case(kind: str, n: int, args):
    """A function running forward+backward for one kind at length n, and its tile fraction."""
    import torch

    import qkv
    from qkv.core.linear import draw_orthogonal_features, linear_attention
    from qkv.core.retention import retention, retention_decays
    from qkv.core.sparse import global_local

    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, n, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_() for _ in range(3))
    grad = torch.randn(shape, generator=g)
    mask, tiles, backend = None, None, "auto"
    if kind in ("softmax_causal", "causal_fused"):
        mask = qkv.causal()
        backend = "fused" if kind == "causal_fused" else "auto"
    elif kind == "sliding_window":
        mask = qkv.sliding_window(args.window)
    elif kind == "longformer":
        mask = global_local(args.window // 2, args.global_tokens) & qkv.causal()
    elif kind == "bigbird":
        mask = global_local(args.window // 2, args.global_tokens, random_blocks=2,
                            block_size=512, max_len=args.max_n) & qkv.causal()
    if kind.startswith("linear"):
        projection = None
        if kind == "linear_favor":
            projection = draw_orthogonal_features(args.features, args.head_dim, generator=g)
        feature_map = "favor" if projection is not None else "elu"

        def run():
            return linear_attention(q, k, v, feature_map=feature_map, projection=projection,
                                    causal=True, chunk_size=args.chunk_size)
    elif kind == "retention":
        gamma = retention_decays(args.heads)

        def run():
            return retention(q, k, v, gamma, form="chunkwise", chunk_size=args.chunk_size)
    else:
        def run():
            return qkv.attention(q, k, v, mask=mask, backend=backend)

    engine = "-"
    if kind in QUADRATIC or mask is not None:
        from qkv import engines
        from qkv.core.problem import build_problem
        from qkv.engines.cpu.tiles import block_sizes

        problem = build_problem(q, k, v, mask=mask, score_mod=None, similarity="dot",
                                scale=None, metric=None, dropout_p=0.0, return_weights=False)
        engine = engines.plan(problem, backend).engine
        if engine == "fused":  # the engine that skips tiles
            bq, bk, _ = block_sizes(args.batch, args.heads, n, n)
            states = mask.tile_states(args.batch, args.heads, n, n, bq, bk)
            tiles = (states != 0).float().mean().item()

    def step():
        out = run()
        out.backward(grad)
        for t in (q, k, v):
            t.grad = None

    return step, engine, tiles


def worker(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warm, _, _ = make_case(args.worker, 512, args)
    warm()
    growth = 4.0 if args.worker in QUADRATIC else 2.2  # per doubling of N, with some slack
    last = prev_n = None
    for n in args.ns:
        predicted = None if last is None else last * growth ** math.log2(n / prev_n)
        if predicted is not None and predicted > args.case_budget:
            print(json.dumps({"n": n, "skipped": round(predicted, 1)}))
            sys.stdout.flush()
            continue
        step, engine, tiles = make_case(args.worker, n, args)
        gc.collect()
        release_freed_memory()
        base = rss_bytes()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        peak = max(0, peak_rss_bytes() - base)
        last, prev_n = min(times), n
        print(json.dumps({"n": n, "seconds": last, "peak_mib": peak / 2**20,
                          "engine": engine, "tiles": tiles}))
        sys.stdout.flush()
        del step
        gc.collect()


def header(args) -> str:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return (
        f"# long_context: B={args.batch} H={args.heads} D={args.head_dim} float32, forward+"
        f"backward, best of {args.repeats}\n# window={args.window} global={args.global_tokens} "
        f"chunk={args.chunk_size} favor features={args.features}\n# torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M %Z')}"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", nargs="+", default=KINDS, choices=KINDS)
    parser.add_argument("--min-n", type=int, default=1024)
    parser.add_argument("--max-n", type=int, default=65536)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--global-tokens", type=int, default=16)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--case-budget", type=float, default=10.0,
                        help="skip a case predicted to take longer than this many seconds")
    parser.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--ns", type=int, nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    ns, n = [], args.min_n
    while n <= args.max_n:
        ns.append(n)
        n *= 2
    passthrough = _strip_kinds(argv if argv is not None else sys.argv[1:])
    print(header(args))
    print(f"{'kind':<16}{'engine':>9}{'N':>8}{'fwd+bwd ms':>12}{'x prev N':>10}"
          f"{'peak MiB':>10}{'tiles':>7}")
    for kind in args.kinds:
        cmd = [sys.executable, __file__, *passthrough, "--worker", kind,
               "--ns", *map(str, ns)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        previous = None
        for line in proc.stdout:
            row = json.loads(line)
            if "skipped" in row:
                print(f"{kind:<16}{'':>9}{row['n']:>8}   skipped (predicted {row['skipped']} s; "
                      f"raise --case-budget)")
                continue
            ratio = "" if previous is None else f"{row['seconds'] / previous:.2f}"
            tiles = "" if row["tiles"] is None else f"{row['tiles']:.3f}"
            print(f"{kind:<16}{row['engine']:>9}{row['n']:>8}{row['seconds'] * 1e3:>12.1f}"
                  f"{ratio:>10}{row['peak_mib']:>10.1f}{tiles:>7}")
            sys.stdout.flush()
            previous = row["seconds"]
        if proc.wait() != 0:
            print(f"{kind:<16} worker failed with exit code {proc.returncode}")


def _strip_kinds(argv: list[str]) -> list[str]:
    """Drop the values of --kinds from the arguments passed on to a worker."""
    out, skipping = [], False
    for a in argv:
        if a.startswith("--"):
            skipping = False
        if skipping:
            continue
        out.append(a)
        if a == "--kinds":
            out.pop()
            skipping = True
    return out


if __name__ == "__main__":
    main()
