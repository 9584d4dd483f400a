"""The CPU engines' workers: one per torch thread, each running its share of the query blocks
(the fused engine) or edge chunks (the graph engine) single-threaded.

A task whose results depend on which worker ran what (the backward: each worker sums its own
gradients) gets a fixed split by cost, so every run adds in the same order; a task whose
results do not (the forward: each block writes its own rows) takes its items from one shared
queue, so neither worker waits for the other.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

_POOL: ThreadPoolExecutor | None = None


def _costliest_first(plan, cost) -> list[int]:
    """The indices of the non-empty items of ``plan``, costliest first (ties in index order)."""
    return sorted((i for i, item in enumerate(plan) if item), key=lambda i: -cost(plan[i]))


def split_blocks(plan, workers: int, cost) -> list[list[int]]:
    """The indices of the non-empty items of ``plan`` in ``workers`` parts of near-equal
    ``cost(item)``, each in ascending order: the costliest item first to the least-loaded part
    (ties to the first). With equal items that deals them out in turn; under a causal mask at
    N=4096, dealing query blocks in turn gave two workers 32,768 and 34,816 keys to visit.
    The split depends on the plan only, so every run sums the gradients in the same order."""
    loads, parts = [0] * workers, [[] for _ in range(workers)]
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


def run_split(task, plan, cost, order_free: bool = False) -> list:
    """Run ``task(indices)`` on torch's thread count of workers over the non-empty items of
    ``plan`` (query blocks' spans, or graph chunks), each worker given its part by
    ``split_blocks`` with ``cost``; with ``order_free`` (a task whose results do not depend
    on which worker ran which item, as the forward's rows), an iterator over one shared queue
    instead: the two cores of a shared machine often run 10-20 % apart, and a fixed split
    waits for the slower.

    Each worker runs its ops single-threaded. One parallel region per worker, instead of one
    per small tile op, keeps both cores busy without a barrier per op; on a shared machine a
    per-op barrier across cores costs more than the op itself."""
    global _POOL
    items = [i for i, item in enumerate(plan) if item]
    workers = max(1, min(torch.get_num_threads(), len(items)))
    if workers == 1:
        return [task(items)]
    if _POOL is None or _POOL._max_workers < workers:
        _POOL = ThreadPoolExecutor(workers, thread_name_prefix="qkv-fused")
    threads = torch.get_num_threads()

    def single_threaded(part):
        torch.set_num_threads(1)  # the calling thread's OpenMP/MKL setting
        return task(part)

    try:
        if order_free:
            take = _shared_queue(_costliest_first(plan, cost))
            parts = [take() for _ in range(workers)]
        else:
            parts = split_blocks(plan, workers, cost)
        futures = [_POOL.submit(single_threaded, part) for part in parts]
        return [f.result() for f in futures]
    finally:
        torch.set_num_threads(threads)  # torch also keeps a process-wide default for new threads
