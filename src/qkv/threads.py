"""How many CPU threads torch runs on: ``--threads N``, or an automatic choice.

torch's OpenMP threads wait on each other at the end of every parallel operation, so when
another job holds a core, each operation waits for the thread that lost its core: beside a
busy job on 2 cores, SmolLM2's 64-token prefill takes 0.14-5.2 s on 2 threads and 0.23-0.25 s
on 1 (docs/training.md, "Threads"). The automatic choice therefore leaves out the cores the
last minute's load average says are taken, and says so on stderr. An OMP_NUM_THREADS in the
environment is a choice already made, and stands.

Before any of that, ``import qkv`` makes MKL choose its vector math kernels on one thread
(``choose_vml_kernels``): chosen on several threads at once, one of them can compute its share
of that call to about half the bits.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

# torch's own choice (OMP_NUM_THREADS, else the cores), read before any command changes it.
TORCH_DEFAULT = torch.get_num_threads()
HELP = ("torch's CPU threads (default: one per core, less the cores that the last minute's "
        "load average says other jobs hold; train: sets train.threads, default the preset's)")
# What `qkv --help` says about the option every command takes.
SUMMARY = ("Every command takes --threads N, torch's CPU threads: by default one per core, fewer\n"
           "while other jobs load the machine (a line on stderr says so).")


def add_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", metavar="N", help=HELP)


def parse(text: str | None) -> int | None:
    """``--threads`` as a positive integer, or None when it was not given."""
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or value > 4096:
        raise ValueError(f"--threads: expected a whole number of threads in [1, 4096], got "
                         f"{text!r}")
    return value


def load_average() -> float:
    """Runnable processes over the last minute (0 where the platform has no load average)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def automatic() -> tuple[int, str | None]:
    """The thread count to use, and the note to print when it is below torch's default.
    A core counts as taken when the load uses more than half of it."""
    if "OMP_NUM_THREADS" in os.environ:
        return TORCH_DEFAULT, None
    load, count = load_average(), cores()
    threads = max(1, min(TORCH_DEFAULT, count - round(load)))
    if threads == TORCH_DEFAULT:
        return threads, None
    return threads, (f"qkv: the machine is busy (load average {load:.1f} on {count} cores): "
                     f"running on {threads} thread{'s' if threads > 1 else ''} instead of "
                     f"{TORCH_DEFAULT}; --threads N chooses")


def configure(threads: int | None) -> int:
    """Set torch's thread count: ``threads``, or the automatic choice (None or 0)."""
    if not threads:
        threads, note = automatic()
        if note:
            print(note, file=sys.stderr, flush=True)
    torch.set_num_threads(threads)
    return threads


# The unary functions that torch computes with MKL's vector math (VML) on contiguous float32
# and float64 tensors (ATen's cpu/vml.h), each a kernel of its own per precision.
_VML_FUNCTIONS = (torch.acos, torch.asin, torch.atan, torch.cos, torch.erf, torch.erfc,
                  torch.erfinv, torch.exp, torch.log, torch.log10, torch.log2, torch.sin,
                  torch.sqrt, torch.tan, torch.tanh, torch.trunc)


def choose_vml_kernels() -> None:
    """Call each of MKL's vector math functions once, on one element (so on this thread
    alone), in float32 and float64. oneMKL 2024.2, which torch's wheels link, chooses a
    function's kernel on its first call; when that call runs on several of torch's threads at
    once (a first torch.exp of a large tensor, or the CPU engines' workers), one thread can
    run a low-accuracy kernel for its whole share of it while another chooses, as on Intel
    Xeons: a float64 exp then errs by about 1e-8 on one thread's half of the tensor, in that
    call only. After one call on one thread the choice is made, and later calls on any
    thread get the full-accuracy kernel."""
    if not torch.backends.mkl.is_available():
        return
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for function in _VML_FUNCTIONS:
            function(x)
