"""FSDP's memory per rank: the bytes of parameters, gradients and AdamW state each rank holds
after one training step of a GPT (about 110M parameters by default), at P = 1 (no sharding:
what every DDP rank holds) and P > 1 gloo ranks on this machine with ``train.fsdp``'s
sharding (``qkv.train.sharding.shard``). The counts are of the tensors themselves (a DTensor's
local shard), not of the process: activations and gathered weights come and go.

    python benchmarks/fsdp_memory.py                    # P = 1 and 4
    python benchmarks/fsdp_memory.py --worlds 1 2 --layers 4

``--fine-tune`` measures the processes instead: ``qkv train lm --init smollm2`` on the text of
docs/*.md (``train.steps`` 4 of 1,024 tokens, the fine-tune defaults: activation
checkpointing, a checkpoint per step), in one process, on two torchrun ranks with
``train.fsdp=true``, and in one process with the allocator setting FSDP takes, one run after
the other; each process's peak resident set (VmHWM, read as it exits) and the losses.

    python benchmarks/fsdp_memory.py --fine-tune
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor


def local_bytes(tensors) -> int:
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def _rank(rank: int, world: int, folder: str, args: argparse.Namespace) -> None:
    from qkv.models import GPT, GPTConfig
    from qkv.train.config import TrainConfig
    from qkv.train.distributed import Env
    from qkv.train.sharding import shard

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.tokens, n_layer=args.layers,
                       block={"d_model": args.d_model, "n_head": args.d_model // 64,
                              "d_ff": 4 * args.d_model})
    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        shard(model, Env(rank, world, torch.device("cpu")), TrainConfig(fsdp=True))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, args.vocab, (1, args.tokens))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    optimizer.step()  # AdamW's state exists from here on
    params = list(model.parameters())
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    sizes = {"parameters": local_bytes(params), "n_parameters": n_params,
             "gradients": local_bytes(p.grad for p in params if p.grad is not None),
             "optimizer": local_bytes(state)}
    if world > 1:
        dist.destroy_process_group()
    Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(sizes))


def measure(world: int, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        procs = [mp.get_context("spawn").Process(target=_rank, args=(r, world, folder, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode for p in procs):
            raise SystemExit(f"a rank of P = {world} failed")
        return [pickle.loads(Path(folder, f"rank{r}.pkl").read_bytes()) for r in range(world)]


def peak_resident_bytes() -> int:
    """This process's peak resident set (VmHWM): ru_maxrss would keep the peak of the
    launcher it was forked from."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit("no VmHWM in /proc/self/status (Linux only)")


def as_rank(folder: str, argv: list[str]) -> int:
    """``qkv`` with ``argv`` in this process (one torchrun rank, or the only process), then
    its peak into FOLDER/peak-WORLD-RANK.txt."""
    from qkv.cli import main as qkv_main

    code = qkv_main(argv)
    world, rank = os.environ.get("WORLD_SIZE", "1"), os.environ.get("RANK", "0")
    Path(folder, f"peak-{world}-{rank}.txt").write_text(str(peak_resident_bytes()))
    return code


# The runs of --fine-tune: (label, processes, environment). train.fsdp fixes glibc's mmap
# threshold at 1 MiB (qkv.allocations.map_large_allocations); the third run gives one process
# the same.
FINE_TUNE_RUNS = (("1 process", 1, {}), ("2 FSDP ranks", 2, {}),
                  ("1 process, MALLOC_MMAP_THRESHOLD_=1048576", 1,
                   {"MALLOC_MMAP_THRESHOLD_": "1048576"}))


def fine_tune(steps: int) -> int:
    """The SmolLM2 fine-tune in one process, on two FSDP ranks, and in one process with the
    allocator setting FSDP takes, one after the other; peaks and losses."""
    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as folder:
        text = Path(folder, "docs.txt")
        text.write_text("\n\n".join(p.read_text() for p in sorted(root.glob("docs/*.md"))))
        runs = []
        for i, (label, world, env) in enumerate(FINE_TUNE_RUNS):
            run_dir, peaks = Path(folder, f"run-{i}"), Path(folder, f"peaks-{i}")
            peaks.mkdir()
            argv = ["train", "lm", "--init", "smollm2", "--run-dir", str(run_dir),
                    "--set", f"data.path={text}", "--set", f"train.steps={steps}"]
            launch = [sys.executable]
            if world > 1:
                launch += ["-m", "torch.distributed.run", "--standalone",
                           f"--nproc_per_node={world}"]
                argv += ["--set", "train.fsdp=true"]
            subprocess.run([*launch, __file__, "--as-rank", str(peaks), "--", *argv],
                           check=True, env={**os.environ, **env})
            records = [json.loads(line) for line in
                       (run_dir / "metrics.jsonl").read_text().splitlines()]
            runs.append((label, [int(Path(peaks, f"peak-{world}-{r}.txt").read_text())
                                 for r in range(world)],
                         [r["loss"] for r in records if "loss" in r]))
    one = runs[0][1][0]
    for label, peaks, losses in runs:
        ranks = ", ".join(f"rank {r} {peak / 1e9:.2f} GB ({peak / one:.2f}x)"
                          for r, peak in enumerate(peaks))
        print(f"{label}: peak {ranks}; losses {', '.join(f'{x:.4f}' for x in losses)}")
    print(f"the largest FSDP rank against one process with the same setting: "
          f"{max(runs[1][1]) / runs[2][1][0]:.2f}x")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-rank"]:  # a process of --fine-tune: FOLDER -- qkv's arguments
        return as_rank(argv[1], argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fine-tune", action="store_true",
                        help="SmolLM2's fine-tune: peak memory of 1 process and 2 FSDP ranks")
    parser.add_argument("--steps", type=int, default=4, help="--fine-tune's steps")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=64, help="one sequence of this length")
    args = parser.parse_args(argv)
    if args.fine_tune:
        return fine_tune(args.steps)
    totals = {}
    for world in args.worlds:
        for rank, sizes in enumerate(measure(world, args)):
            total = sizes["parameters"] + sizes["gradients"] + sizes["optimizer"]
            totals.setdefault(world, []).append(total)
            print(f"P={world} rank {rank}: {sizes['n_parameters'] / 1e6:.1f}M parameters; "
                  f"holds parameters {sizes['parameters'] / 2**20:.1f} MiB, gradients "
                  f"{sizes['gradients'] / 2**20:.1f} MiB, AdamW state "
                  f"{sizes['optimizer'] / 2**20:.1f} MiB, total {total / 2**20:.1f} MiB",
                  flush=True)
    if 1 in totals:
        for world, per_rank in totals.items():
            print(f"P={world}: the largest rank holds {max(per_rank) / totals[1][0]:.3f} of "
                  "P=1's bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
