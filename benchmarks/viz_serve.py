"""``qkv viz --serve`` at full context: the time to the first view (one forward pass keeping
q and k on disk, the server up, the page's first requests answered) and each later request,
with the process's peak memory, in one process.

    python benchmarks/viz_serve.py                        # SmolLM2, 8,192 tokens of docstrings
    python benchmarks/viz_serve.py --random-gpt 32768     # a random GPT with RoPE, SmolLM2's shape

The first view is what the page asks for when it opens: the token list and the whole map of
layer 0, head 0, pooled to 512 x 512. Later requests: full rows (all heads of a layer) at
several positions, and exact 512 x 512 windows. Times are wall-clock over HTTP on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from qkv.data.docstrings import stdlib_docstrings
from qkv.models import GPT, GPTConfig, load_pretrained
from qkv.viz.qk_store import QKStore
from qkv.viz.scene import without_head
from qkv.viz.serve import Server, Viewer


def model_and_ids(args):
    if args.random_gpt:
        torch.manual_seed(0)
        block = {"n_head": 9, "n_kv_head": 3, "d_model": 576, "dropout": 0.0}
        model = GPT(GPTConfig(vocab_size=49152, block_size=args.random_gpt, n_layer=30,
                              block=block, positions={"kind": "rope"}))
        ids = torch.randint(0, 49152, (args.random_gpt,),
                            generator=torch.Generator().manual_seed(1)).tolist()
        return model.eval(), ids, "random GPT (SmolLM2's shape, RoPE)"
    model, tokenizer = load_pretrained(args.model)
    ids = tokenizer.encode(stdlib_docstrings(1_200_000))[: args.tokens]
    return model.eval(), ids, args.model


def get(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=600) as reply:
        size = len(reply.read())
    return time.perf_counter() - start, size


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--random-gpt", type=int, metavar="N", help="a random GPT over N tokens")
    args = p.parse_args()
    start = time.perf_counter()
    model, ids, name = model_and_ids(args)
    loaded = time.perf_counter() - start
    n = len(ids)
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; {name}, {n} tokens; loaded in {loaded:.1f} s")
    with tempfile.TemporaryDirectory() as folder:
        start = time.perf_counter()
        with without_head(model):
            store = QKStore.record(model, lambda: model(torch.tensor([ids])),
                                   Path(folder) / "qk")
        recorded = time.perf_counter() - start
        server = Server(Viewer(store, [str(i) for i in ids], name))
        server.start()
        meta, _ = get(server.url + "api/meta")
        whole, _ = get(server.url + f"api/window?layer=0&head=0&q0=0&q1={n}&k0=0&k1={n}&size=512")
        first_view = recorded + meta + whole
        rows = [get(server.url + f"api/row?layer={layer}&head=all&q={q}")[0]
                for layer in (0, 15, 29) for q in (n // 3, n - 200, n - 1)]
        windows = [get(server.url + f"api/window?layer=10&head=2&q0={q}&q1={q + 512}&k0=0"
                       f"&k1=512&size=512")[0] for q in (1000, n // 2, n - 512)]
        pooled = [get(server.url + f"api/window?layer={layer}&head=1&q0=0&q1={n}&k0=0&k1={n}"
                      "&size=512")[0] for layer in (5, 20)]
        server.stop()
        disk = sum(f.stat().st_size for f in (Path(folder) / "qk").iterdir()) / 2**20
        store.close()
    print("| tokens | forward + store s | first view s | row (all heads) s, median / max | "
          "exact 512x512 window s | whole map pooled s | peak GB | q, k on disk MB |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {n} | {recorded:.1f} | {first_view:.1f} | {statistics.median(rows):.2f} / "
          f"{max(rows):.2f} | {statistics.median(windows):.2f} | {statistics.median(pooled):.2f} "
          f"| {peak_gb():.2f} | {disk:.0f} |")
    print(json.dumps({"tokens": n, "record_s": recorded, "first_view_s": first_view,
                      "row_s": rows, "window_s": windows, "pooled_s": pooled,
                      "peak_gb": peak_gb()}))


if __name__ == "__main__":
    main()
