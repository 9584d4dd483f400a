"""Run a function on P gloo ranks in fresh processes, with a time limit so nothing hangs.

The ranks fork from a server (multiprocessing's "forkserver") that has imported torch, qkv
and these tests' modules once, instead of each rank importing them anew (2-3 s a rank on
2 cores). The server is a clean single-threaded process, so a fork of it is a fresh process
with those modules loaded; it starts on the first call and keeps that call's environment.
"""

from __future__ import annotations

import datetime
import pickle
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(fn, rank: int, world: int, folder: str, args: tuple) -> None:
    torch.set_num_threads(1)
    result: tuple
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        result = ("ok", fn(rank, world, *args))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, whatever it is)
        result = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    Path(folder, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


# What every rank imports: torch's distributed packages, qkv's, and the modules whose
# functions run on the ranks.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "qkv", "qkv.cli",
           "qkv.distributed", "qkv.train.loop", "tests.distributed.cases",
           "tests.distributed.weightings", "tests.distributed.test_fsdp",
           "tests.distributed.test_fsdp_init", "tests.distributed.test_vocab"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts: on the first call
    return ctx


def run_ranks(fn, world: int, *args, timeout: float = 180.0) -> list[tuple]:
    """``fn(rank, world, *args)`` on ``world`` ranks; returns each rank's ("ok", value) or
    ("error", message, traceback). A rank still running after ``timeout`` s fails the call."""
    ctx = _context()
    with tempfile.TemporaryDirectory() as folder:
        procs = [ctx.Process(target=_entry, args=(fn, r, world, folder, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not hung, f"ranks {hung} did not finish within {timeout} s"
        return [pickle.loads(Path(folder, f"rank{r}.pkl").read_bytes()) for r in range(world)]


def values(results: list[tuple]) -> list:
    """Every rank's value; fails with the first rank's error and traceback."""
    for r, res in enumerate(results):
        assert res[0] == "ok", f"rank {r}: {res[1]}\n{res[2]}"
    return [res[1] for res in results]
