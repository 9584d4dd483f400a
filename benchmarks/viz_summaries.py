"""Summaries of every layer and head of a pretrained model at its full context: wall time and
peak memory of ``qkv.viz.summaries.summarize`` (entropy, distance, sink mass per row, the
mass each key receives, each row's top keys) over real English text, in one process.

The text is the standard library's docstrings cut to ``--tokens`` tokens. Peak memory is
the process's maximum resident set (``ru_maxrss``), model and text included.

    python benchmarks/viz_summaries.py                      # smollm2, 8192 tokens
    python benchmarks/viz_summaries.py --tokens 2048
"""

from __future__ import annotations

import argparse
import platform
import resource
import time

import torch

from qkv.data.docstrings import stdlib_docstrings
from qkv.models import load_pretrained
from qkv.viz.scene import without_head
from qkv.viz.summaries import ROW_BYTES, summarize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--row-mb", type=int, default=ROW_BYTES >> 20,
                   help="scores a worker holds at once, MB")
    args = p.parse_args()
    model, tokenizer = load_pretrained(args.model)
    model.eval()
    ids = tokenizer.encode(stdlib_docstrings(400_000))[: args.tokens]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {args.model}, {len(ids)} tokens")
    start = time.perf_counter()
    with without_head(model):
        stats = summarize(model, lambda: model(torch.tensor([ids])),
                          row_bytes=args.row_mb << 20)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    kept = sum(t.numel() * t.element_size() for s in stats.values()
               for t in (s.entropy, s.distance, s.sink, s.previous, s.received, s.top_keys,
                         s.top_weights))
    print("| tokens | layers x heads | wall s | peak RSS GB | summaries MB |")
    print("|---|---|---|---|---|")
    heads = len(next(iter(stats.values())).heads)
    print(f"| {len(ids)} | {len(stats)} x {heads} | {seconds:.1f} | {peak:.2f} | "
          f"{kept / 2**20:.1f} |")


if __name__ == "__main__":
    main()
