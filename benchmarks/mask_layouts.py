"""Host time of a mask's tile classification, made anew against kept between calls
(``Mask.layout_key``): the Triton engine's block layout (the three tables of a forward and
backward, on CPU tensors here) and the fused CPU engine's tile plan, for a segments mask over
a new tensor each call (always made) and over the same one (kept).

    python benchmarks/mask_layouts.py
    python benchmarks/mask_layouts.py --n 8192 --document 1024 --batch 2 --heads 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import qkv
from qkv.core.similarity import DOT
from qkv.engines.cpu.tiles import TileSpec, block_sizes, tile_plan
from qkv.engines.lowering import Lowered
from qkv.engines.triton.blocks import block_layout


def triton_layout(ids: torch.Tensor, args: argparse.Namespace) -> None:
    layout = block_layout(qkv.segments(ids), args.batch, args.heads, args.n, args.n, 32, 32,
                          "cpu")
    layout.table(128, 64)
    layout.table(64, 128, by_keys=True)


def cpu_plan(ids: torch.Tensor, args: argparse.Namespace) -> None:
    block_q, block_k, span_k = block_sizes(args.batch, args.heads, args.n, args.n)
    spec = TileSpec(Lowered(DOT, None, qkv.segments(ids), None), args.batch, args.heads,
                    args.n, args.n, 0.0, 0, block_q, block_k)
    spec.span_k = span_k
    tile_plan(spec, "cpu")


def median_ms(step, make, args: argparse.Namespace) -> float:
    for _ in range(3):
        step(make(), args)
    times = []
    for _ in range(args.repeat):
        ids = make()
        start = time.perf_counter()
        step(ids, args)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--document", type=int, default=1024, help="tokens per document")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = (torch.arange(args.n) // args.document).expand(args.batch, args.n).contiguous()
    print(f"segments of {args.document} tokens, B={args.batch} H={args.heads} N={args.n}, "
          f"one thread; median of {args.repeat} calls")
    for name, step in (("Triton block layout", triton_layout), ("CPU tile plan", cpu_plan)):
        made = median_ms(step, ids.clone, args)
        kept = median_ms(step, lambda: ids, args)
        print(f"{name}: made {made:.3f} ms, kept {kept:.3f} ms ({made / kept:.0f}x)")


if __name__ == "__main__":
    main()
