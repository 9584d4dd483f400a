"""The CPU engines' workers: one per torch thread, each running its share of the query blocks
(the fused engine) or edge chunks (the graph engine) single-threaded.

A task whose results do not depend on which worker ran what (the forward: each block writes
its own rows) takes its items from one shared queue, so neither worker waits for the other.
A task that sums (the backward's key-side gradients) runs in *chains*: fixed lists of items,
each with its own sums, which take their items in order whichever worker runs them, so every
run adds in the same order; a worker takes the next item of whichever free chain has the
most work left, so a slower core runs fewer items instead of holding up the call.

The workers are the threads of torch's own OpenMP team (``workers_team.c``), the caller's
among them, or a thread pool's where no C compiler builds that runner.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import native

_POOL: ThreadPoolExecutor | None = None


def _costliest_first(plan, cost) -> list[int]:
    """The indices of the non-empty items of ``plan``, costliest first (ties in index order)."""
    return sorted((i for i, item in enumerate(plan) if item), key=lambda i: -cost(plan[i]))


def split_blocks(plan, count: int, cost) -> list[list[int]]:
    """The indices of the non-empty items of ``plan`` in ``count`` parts (the backward's
    chains) of near-equal ``cost(item)``, each in ascending order: the costliest item first
    to the least-loaded part (ties to the first). With equal items that deals them out in
    turn; under a causal mask at N=4096, dealing query blocks in turn gave two parts 32,768
    and 34,816 keys to visit. The split depends on the plan only, so every run sums the
    gradients in the same order."""
    loads, parts = [0] * count, [[] for _ in range(count)]
    for i in _costliest_first(plan, cost):
        w = loads.index(min(loads))
        parts[w].append(i)
        loads[w] += cost(plan[i])
    return [sorted(part) for part in parts]


def _shared_queue(order: list[int]) -> Callable[[], Iterator[int]]:
    """A maker of iterators over one queue of ``order``: each index goes to whichever
    worker's iterator asks next (``deque.popleft`` is atomic)."""
    queue = deque(order)

    def take():
        while True:
            try:
                yield queue.popleft()
            except IndexError:
                return

    return take


def _items_and_workers(plan) -> tuple[list[int], int]:
    """The indices of ``plan``'s non-empty items, and how many workers they get: torch's
    thread count, at least one and at most one per item."""
    items = [i for i, item in enumerate(plan) if item]
    return items, max(1, min(torch.get_num_threads(), len(items)))


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="qkv-fused")
    return _POOL


_JOB = ctypes.CFUNCTYPE(None, ctypes.c_int64)


@functools.cache
def _team():
    """``qkv_run_on_team`` (``workers_team.c``, built with -fopenmp), or None where it does
    not build; the thread pool serves then."""
    lib = native.optional_library(Path(__file__).with_name("workers_team.c"), "workers_team",
                                  ("-fopenmp",))
    if lib is None:
        return None
    lib.qkv_run_on_team.argtypes = [ctypes.c_int64, _JOB]
    lib.qkv_run_on_team.restype = None
    return lib.qkv_run_on_team


def _on_workers(workers: int, job: Callable, args: list) -> list:
    """``job(arg)`` for each of ``args`` (one per worker), each single-threaded: one parallel
    region per worker, instead of one per small tile op, keeps both cores busy without a
    barrier per op; on a shared machine a per-op barrier across cores costs more than the op
    itself. The workers are the threads of torch's own OpenMP team where the small C runner
    builds (``workers_team.c`` says why), else a thread pool's."""
    threads = torch.get_num_threads()
    results: list = [None] * len(args)
    errors: list[BaseException] = []

    def single_threaded(i):
        # The team's first thread is the caller's: give each job a new thread's grad mode and
        # no autocast, whichever thread runs it, as the pool's threads had.
        try:
            torch.set_num_threads(1)  # the calling thread's OpenMP/MKL setting
            with torch.enable_grad(), torch.autocast("cpu", enabled=False):
                results[i] = job(args[i])
        except BaseException as error:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors.append(error)

    try:
        team = _team()
        if team is not None:
            team(len(args), _JOB(single_threaded))
        else:
            for future in [_pool(workers).submit(single_threaded, i) for i in range(len(args))]:
                future.result()
    finally:
        torch.set_num_threads(threads)  # torch also keeps a process-wide default for new threads
    if errors:
        raise errors[0]
    return results


def run_queued(task, plan, cost) -> list:
    """Run ``task(indices)`` on torch's thread count of workers over the non-empty items of
    ``plan`` (query blocks' spans, or graph chunks), for a task whose results do not depend
    on which worker ran which item (the forward's rows): each worker's ``indices`` iterate
    one shared queue, costliest item (by ``cost``) first. The two cores of a shared machine
    often run 10-20 % apart, and a fixed split would wait for the slower."""
    items, workers = _items_and_workers(plan)
    if workers == 1:
        return [task(items)]
    take = _shared_queue(_costliest_first(plan, cost))
    return _on_workers(workers, task, [take() for _ in range(workers)])


# The chains' sums together stay under this (or one set per worker, if that is more): at
# N=4096 (8 heads, D=64) a set of key-side sums is 16 MiB, at N=16384 64 MiB, at N=65536
# 256 MiB.
CHAIN_BUDGET_BYTES = 256 << 20


def chain_count(workers: int, items: int, chain_bytes: int) -> int:
    """One chain more than the workers (so a worker that ends an item finds a free chain
    until the last items: its own, and the one no worker runs), or just the workers where
    the extra sums would pass ``CHAIN_BUDGET_BYTES``; never more than the items; one for one
    worker."""
    if workers == 1:
        return 1
    extra = (workers + 1) * chain_bytes <= CHAIN_BUDGET_BYTES
    return max(1, min(items, workers + extra))


def run_in_chains(step, plan, cost, start_chain, start_worker, chain_bytes: int) -> list:
    """``step(index, sums, scratch)`` for every non-empty item of ``plan``, without autograd
    recording, in chains (see the module's docstring): ``sums = start_chain()`` once per
    chain, when it first runs (at the end for a chain with nothing to run: zeros);
    ``scratch = start_worker()`` once per worker. Returns the chains' sums in chain order,
    which with the chains (``split_blocks`` by ``cost``) depends on the plan, the thread
    count and ``chain_bytes`` (one chain's sums) only."""
    items, workers = _items_and_workers(plan)
    chains = split_blocks(plan, chain_count(workers, len(items), chain_bytes), cost)
    left = [sum(cost(plan[i]) for i in chain) for chain in chains]
    taken = [0] * len(chains)
    busy = [False] * len(chains)
    sums: list = [None] * len(chains)
    lock = threading.Lock()

    def take(done: int | None) -> tuple[int, int] | None:
        """Free chain ``done``; the next item of the free chain with the most work left."""
        with lock:
            if done is not None:
                busy[done] = False
            free = [c for c, chain in enumerate(chains) if not busy[c] and taken[c] < len(chain)]
            if not free:  # the items left are the running chains' own
                return None
            c = max(free, key=lambda c: left[c])
            i = chains[c][taken[c]]
            busy[c], taken[c], left[c] = True, taken[c] + 1, left[c] - cost(plan[i])
            return c, i

    def work(_):
        scratch, chain = start_worker(), None
        with torch.no_grad():
            while (picked := take(chain)) is not None:
                chain, i = picked
                if sums[chain] is None:
                    sums[chain] = start_chain()
                step(i, sums[chain], scratch)

    if workers == 1:
        work(None)
    else:
        _on_workers(workers, work, [None] * workers)
    return [start_chain() if chain_sums is None else chain_sums for chain_sums in sums]


def sum_chains(parts: list[list], buffers: int) -> list:
    """The chains' gradient lists (``run_in_chains`` with ``tiles.grad_sums``) summed
    position by position, in chain order, so every element adds in the same order. The
    first ``buffers`` positions (contiguous zero buffers, the chains' own) are summed in
    place into the first chain's, each worker taking a range of their elements; the rest
    (a tensor's gradient, or None for zero) on this thread."""
    total = list(parts[0])
    for part in parts[1:]:
        total[buffers:] = [a if b is None else b if a is None else a + b
                           for a, b in zip(total[buffers:], part[buffers:], strict=True)]
    if len(parts) == 1:
        return total
    flat = [[part[e].view(-1) for part in parts] for e in range(buffers)]
    size = sum(f[0].numel() for f in flat)
    workers = max(1, min(torch.get_num_threads(), size // (1 << 16)))

    def add_range(w):
        for chains in flat:
            n = chains[0].numel()
            lo, hi = n * w // workers, n * (w + 1) // workers
            for other in chains[1:]:
                chains[0][lo:hi] += other[lo:hi]

    if workers == 1:
        add_range(0)
    else:
        _on_workers(workers, add_range, list(range(workers)))
    return total
