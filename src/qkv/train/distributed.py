"""DDP under torchrun: gloo on CPU, NCCL on GPU; a single process needs no setup at all.
With context parallelism the processes form a (data, context) device mesh."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


@dataclass
class Env:
    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference not in ("auto", "cpu", "cuda"):
        raise ValueError(f"train.device: expected auto, cpu or cuda, got {preference!r}")
    if preference == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' was asked for but no GPU is available")
    use_cuda = preference == "cuda" or (preference == "auto" and torch.cuda.is_available())
    return torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")


def setup(device_preference: str = "auto") -> Env:
    """Join the process group torchrun describes in the environment (WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    if world_size == 1:
        return Env(0, 1, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Env(dist.get_rank(), world_size, device)


@dataclass
class Mesh:
    """This rank's place on the (data, context) mesh: its data-parallel row and the group of
    ranks that share its sequences (None without context parallelism)."""

    data_rank: int
    data_size: int
    context_group: dist.ProcessGroup | None


def check_context_parallel(env: Env, context_parallel: int) -> None:
    if env.world_size % context_parallel:
        raise ValueError(f"train.context_parallel={context_parallel} must divide the number of "
                         f"processes ({env.world_size})")


def mesh(env: Env, context_parallel: int) -> Mesh:
    """Rows of ``context_parallel`` consecutive ranks split one batch slice's sequences."""
    check_context_parallel(env, context_parallel)
    if context_parallel == 1:
        return Mesh(env.rank, env.world_size, None)
    grid = init_device_mesh(env.device.type, (env.world_size // context_parallel,
                                              context_parallel),
                            mesh_dim_names=("data", "context"))
    return Mesh(env.rank // context_parallel, env.world_size // context_parallel,
                grid.get_group("context"))


def teardown() -> None:
    """Leave the process group ``setup`` joined (nothing to do in a single process)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(env: Env) -> None:
    if env.distributed:
        dist.barrier()


def all_sum(env: Env, value: torch.Tensor) -> torch.Tensor:
    if env.distributed:
        value = value.clone()
        dist.all_reduce(value)
    return value


def broadcast_object(env: Env, obj):
    """Rank 0's ``obj`` on every rank (``obj`` itself in a single process)."""
    if not env.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(env: Env, obj) -> list:
    """``obj`` from every rank, in rank order (a one-element list in a single process)."""
    if not env.distributed:
        return [obj]
    out = [None] * env.world_size
    dist.all_gather_object(out, obj)
    return out
