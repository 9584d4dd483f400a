"""FSDP's memory per rank: the bytes of parameters, gradients and AdamW state each rank holds
after one training step of a GPT (about 110M parameters by default), at P = 1 (no sharding:
what every DDP rank holds) and P > 1 gloo ranks on this machine with ``train.fsdp``'s
sharding (``qkv.train.sharding.shard``). The counts are of the tensors themselves (a DTensor's
local shard), not of the process: activations and gathered weights come and go.

    python benchmarks/fsdp_memory.py                    # P = 1 and 4
    python benchmarks/fsdp_memory.py --worlds 1 2 --layers 4
"""

from __future__ import annotations

import argparse
import datetime
import pickle
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=64, help="one sequence of this length")
    args = parser.parse_args(argv)
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
