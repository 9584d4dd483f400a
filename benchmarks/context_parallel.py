"""Context parallelism on CPU: causal L1 attention of one sequence split over P gloo ranks.

For each N, P and layout, every rank runs ``context_parallel_attention`` forward (with
``--backward``: forward and backward) on its shard
(P = 1: plain ``qkv.attention`` on the whole sequence, the single-process baseline) and
reports its time, its extra peak memory (the growth of the resident set's high-water mark,
reset just before the call, with large allocations on mmap so freed tensors leave it), the
bytes it sent against the formula (P-1)·B·Hkv·(N/P)·(D+Dv)·4 (backward: (3P-2)·...: K/V
round the ring twice, dK/dV once all the way home), and the query-key area it
computed (pairs the causal mask leaves empty are skipped): the zigzag layout balances it.

    python benchmarks/context_parallel.py                       # N = 16k and 64k, P = 1, 2, 4
    python benchmarks/context_parallel.py --n 16384 --worlds 1 2
    python benchmarks/context_parallel.py --backward --n 16384 --worlds 1 2

The ranks share this machine's cores: with P ranks on C < P cores the times show the work
per rank and its balance, not a speed-up.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import pickle
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

B, H, D = 1, 2, 64


def _status(key: str) -> float:
    """A /proc/self/status field in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


def _rank(rank: int, world: int, folder: str, n: int, layout: str, backward: bool) -> None:
    import qkv
    from qkv.distributed import context_parallel_attention, shard

    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: freed tensors leave the resident set
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, n, D, generator=g) for _ in range(3))
    kwargs = dict(mask=qkv.causal(), similarity="l1")
    sent = [0]
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=1200))
        q, k, v = (shard(t, rank, world, layout).contiguous() for t in (q, k, v))
        original = dist.batch_isend_irecv

        def counting(ops):
            sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                           if op.op is dist.isend)
            return original(ops)

        dist.batch_isend_irecv = counting
        dist.barrier()
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before = _status("VmRSS")
    start = time.perf_counter()
    with torch.set_grad_enabled(backward):
        for t in (q, k, v):
            t.requires_grad_(backward)
        if world == 1:
            out = qkv.attention(q, k, v, **kwargs)
        else:
            out = context_parallel_attention(q, k, v, layout=layout, **kwargs)
        if backward:
            out.backward(torch.ones_like(out))
    seconds = time.perf_counter() - start
    extra = _status("VmHWM") - before
    area = _causal_area(n, rank, world, layout if world > 1 else "contiguous")
    if world > 1:
        dist.destroy_process_group()
    Path(folder, f"{rank}.pkl").write_bytes(pickle.dumps((seconds, extra, sent[0], area)))


def _causal_area(n: int, rank: int, world: int, layout: str) -> int:
    """Query-key entries of the chunk pairs this rank computes (empty pairs skipped)."""
    from qkv.distributed.layout import chunks

    total = 0
    for _, q0, nq in chunks(layout, rank, world, n // world):
        for owner in range(world):
            for _, k0, nk in chunks(layout, owner, world, n // world):
                total += nq * nk if k0 <= q0 + nq - 1 else 0
    return total


def run(n: int, world: int, layout: str, backward: bool) -> list[tuple]:
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=_rank, args=(r, world, folder, n, layout, backward))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return [pickle.loads(Path(folder, f"{r}.pkl").read_bytes()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layouts", nargs="+", default=["contiguous", "zigzag"])
    parser.add_argument("--backward", action="store_true", help="forward and backward")
    args = parser.parse_args()
    passes = "forward+backward" if args.backward else "forward"
    print(f"# causal L1, {passes}, B={B} H={H} D={D} float32, 1 thread per rank, "
          f"{os.cpu_count()} cores; torch {torch.__version__}, Python "
          f"{platform.python_version()}, {platform.machine()}, {datetime.date.today()}")
    print("| N | P | layout | time max/min rank (s) | extra peak MiB per rank (max) | "
          "vs P=1 | sent MiB per rank | formula MiB | area max/mean |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.n:
        baseline = None
        for world in args.worlds:
            for layout in args.layouts if world > 1 else ["-"]:
                ranks = run(n, world, layout, args.backward)
                seconds = [r[0] for r in ranks]
                extra = max(r[1] for r in ranks)
                baseline = extra if world == 1 else baseline
                sent = max(r[2] for r in ranks) / 2**20
                trips = 3 * world - 2 if args.backward and world > 1 else world - 1
                formula = trips * B * H * (n // world) * 2 * D * 4 / 2**20
                areas = [r[3] for r in ranks]
                ratio = f"{extra / baseline:.2f}x" if baseline else "-"
                print(f"| {n} | {world} | {layout} | {max(seconds):.2f} / {min(seconds):.2f} | "
                      f"{extra:.1f} | {ratio} | {sent:.1f} | {formula:.1f} | "
                      f"{max(areas) / (sum(areas) / len(areas)):.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
