"""torch.compile with qkv on CPU: compiled versus eager, measured side by side in one run.

qkv's fused engines run as custom ops (``qkv::fused_cpu_forward`` / ``_backward``), so a
compiled graph keeps them instead of falling back to an O(N²) materialized reference. Three
tables check that:

1. Attention alone, forward+backward (B=1, H=4, D=64, float32): causal L1, causal ALiBi and
   causal softcap, eager versus ``torch.compile(fn, fullgraph=True)``. Time ratio is
   compiled / eager; memory is the peak extra resident memory of one step (least of three),
   measured in a fresh child process per (variant, N, mode). Target: memory compiled / eager
   <= 1.2. Materialized scores would add B·H·N²·4 bytes (256 MiB at N=4096, 4 GiB at 16384),
   far above the figures; between processes they vary by about ±15 MiB, which can move the
   ratio of small figures (N=4096) past 1.2 by itself. "qkv ops" counts the qkv custom ops
   that one compiled step runs (profiler): 2 (forward and backward) when they are kept.
2. A GPT training step (forward, cross-entropy, backward, AdamW), eager versus a compiled
   loss function (the optimizer step stays eager), with similarity="l1" and with ALiBi.
   Target: eager / compiled >= 1.0 (compiled not slower).
3. Dispatch overhead: causal dot product through ``qkv.attention`` (which sends it to SDPA)
   versus ``F.scaled_dot_product_attention`` called directly, forward, small N, median over
   alternating pairs; both eager and compiled. Target: overhead <= 5%.

The backend is ``aot_eager`` by default (graphs traced through AOTAutograd, run op by op):
inductor's code generation costs more on a small CPU (on 2 cores, 10-15 s for a first graph
with a cold cache, against 1-2 s); ``--backend inductor`` uses it.
"1st call" is the first compiled call's wall time (tracing and compilation plus one run).

    python benchmarks/compile_attention.py --quick              # smoke run, N=512
    python benchmarks/compile_attention.py --sizes 4096 16384   # the full report
    python benchmarks/compile_attention.py --sections 1 --sizes 4096 --backend inductor
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import qkv
from attention_cpu import _cpu_model, peak_extra_memory
from qkv.models import GPT, GPTConfig

B, H, D = 1, 4, 64
VARIANTS = {
    "causal L1": lambda: {"mask": qkv.causal(), "similarity": "l1"},
    "causal ALiBi": lambda: {"mask": qkv.causal(), "score_mod": qkv.alibi(H)},
    "causal softcap": lambda: {"mask": qkv.causal(), "score_mod": qkv.softcap(30.0)},
}
# label -> (the block's fields besides its size, the positions' kind)
GPT_CASES = {"l1": ({"similarity": "l1"}, "learned"), "alibi": ({}, "alibi")}


def print_row(row: list[str]) -> None:
    print("| " + " | ".join(row) + " |", flush=True)


def print_header(header: list[str]) -> None:
    print_row(header)
    print_row(["---"] * len(header))


def compile_fn(fn: Callable, backend: str) -> Callable:
    torch._dynamo.reset()  # every figure its own compilation, none reused from a cache entry
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def once(fn: Callable, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def best_pair(a: Callable, b: Callable, repeat: int) -> tuple[float, float]:
    """Best wall time of a and of b over ``repeat`` alternating runs (warmed up already), so
    drifting machine load hits both alike."""
    times_a, times_b = [], []
    for _ in range(repeat):
        times_a.append(once(a))
        times_b.append(once(b))
    return min(times_a), min(times_b)


@contextlib.contextmanager
def quiet_stderr():
    """The profiler writes start/stop lines to file descriptor 2; hide them."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def qkv_ops(fn: Callable, *args) -> int:
    """How many qkv custom ops (``qkv::*``) one call of ``fn`` runs."""
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    return sum(e.count for e in prof.key_averages() if e.key.startswith("qkv::"))


# 1. Attention alone ------------------------------------------------------------------------


def attention_fn(variant: str) -> Callable:
    kwargs = VARIANTS[variant]()
    return lambda q, k, v: qkv.attention(q, k, v, **kwargs)


def fwd_bwd(attn: Callable, n: int) -> Callable[[], None]:
    """One forward+backward of ``attn`` on fixed inputs of length n (gradients dropped)."""
    gen = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(B, H, n, D, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(B, H, n, D, generator=gen)

    def run():
        attn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None

    return run


def peak_in_child(variant: str, n: int, mode: str, backend: str) -> float | None:
    """Peak extra memory (bytes) of one forward+backward, in a fresh process, after a warm-up
    call (which compiles, in mode "compiled")."""
    done = subprocess.run(
        [sys.executable, __file__, "--backend", backend, "--peak-of", variant, str(n), mode],
        capture_output=True, text=True, check=False,
    )
    words = done.stdout.split()
    if done.returncode != 0 or not words or words[-1] == "None":
        print(f"  (peak of {variant} N={n} {mode} failed: {done.stderr.strip()[-300:]})")
        return None
    return float(words[-1])


def _peak_of(variant: str, n: int, mode: str, backend: str) -> None:
    attn = attention_fn(variant)
    run = fwd_bwd(compile_fn(attn, backend) if mode == "compiled" else attn, n)
    run()  # warm-up: compilation and lazy initialisation stay out of the figure
    # The least of three: one figure varies by tens of MiB from run to run (allocator and
    # thread-pool noise), which would swamp a 1.2 ratio; materialized scores would not hide.
    peaks = [peak_extra_memory(run) for _ in range(3)]
    print(None if None in peaks else min(peaks))


def _mib(x: float | None) -> str:
    return "—" if x is None else f"{x / 2**20:.0f}"


def attention_report(sizes: list[int], repeat: int, backend: str) -> None:
    print(f"\n1. Attention forward+backward, compiled ({backend}) vs eager, B={B} H={H} D={D}; "
          f"best of {repeat}; memory target compiled/eager <= 1.2")
    print_header(["variant", "N", "eager s", "compiled s", "time c/e", "eager MiB",
                  "compiled MiB", "mem c/e", "1st call s", "qkv ops"])
    worst = 0.0
    for n in sizes:
        for variant in VARIANTS:
            eager = fwd_bwd(attention_fn(variant), n)
            compiled = fwd_bwd(compile_fn(attention_fn(variant), backend), n)
            first = once(compiled)
            eager()  # warm-up
            t_eager, t_comp = best_pair(eager, compiled, repeat)
            ops = qkv_ops(compiled)
            m_eager = peak_in_child(variant, n, "eager", backend)
            m_comp = peak_in_child(variant, n, "compiled", backend)
            ratio = m_comp / m_eager if m_eager and m_comp is not None else None
            worst = max(worst, ratio or 0.0)
            print_row([variant, str(n), f"{t_eager:.3f}", f"{t_comp:.3f}",
                       f"{t_comp / t_eager:.2f}", _mib(m_eager), _mib(m_comp),
                       "—" if ratio is None else f"{ratio:.2f}", f"{first:.1f}", str(ops)])
    print(f"worst memory ratio compiled/eager: {worst:.2f} "
          f"({'meets' if worst <= 1.2 else 'MISSES'} target <= 1.2); materialized scores "
          f"would add {', '.join(f'{_mib(B * H * n * n * 4)} MiB at N={n}' for n in sizes)}")


# 2. GPT training step ----------------------------------------------------------------------


def gpt_steppers(config: GPTConfig, backend: str) -> dict[str, Callable]:
    """Training steps (tokens (B, N+1) -> None) of two copies of one GPT, each with its own
    AdamW: "eager" and "compiled" (the loss function compiled; AdamW's step eager)."""
    torch.manual_seed(0)
    model = GPT(config)
    steppers = {}
    for mode, copied in (("eager", model), ("compiled", copy.deepcopy(model))):
        def loss(x, y, model=copied):
            return F.cross_entropy(model(x).flatten(0, 1), y.flatten())

        loss = compile_fn(loss, backend) if mode == "compiled" else loss
        opt = torch.optim.AdamW(copied.parameters(), lr=1e-3)

        def step(tokens, loss=loss, opt=opt):
            loss(tokens[:, :-1], tokens[:, 1:]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steppers[mode] = step
    return steppers


def gpt_report(block: int, batch: int, steps: int, rounds: int, backend: str) -> None:
    print(f"\n2. GPT training step (forward, cross-entropy, backward, AdamW), compiled "
          f"({backend}) vs eager: vocab 256, context {block}, 2 layers, 4 heads, d_model 128, "
          f"batch {batch}; median step of {rounds} rounds x {steps} steps; "
          "target eager/compiled >= 1.0")
    print_header(["model", "eager ms", "compiled ms", "eager/compiled", "1st call s",
                  "qkv ops"])
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (batch, block + 1), generator=gen) for _ in range(steps)]
    for label, (fields, positions) in GPT_CASES.items():
        config = GPTConfig(vocab_size=256, block_size=block, n_layer=2,
                           block={"n_head": 4, "d_model": 128, **fields},
                           positions={"kind": positions})
        steppers = gpt_steppers(config, backend)
        first = once(steppers["compiled"], data[0])
        steppers["eager"](data[0])  # warm-up
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for r in range(rounds):
            order = ("eager", "compiled") if r % 2 == 0 else ("compiled", "eager")
            for mode in order:
                times[mode] += [once(steppers[mode], tokens) for tokens in data]
        ops = qkv_ops(steppers["compiled"], data[0])
        eager, compiled = (statistics.median(times[m]) for m in ("eager", "compiled"))
        print_row([f"GPT {label}", f"{eager * 1e3:.1f}", f"{compiled * 1e3:.1f}",
                   f"{eager / compiled:.2f}", f"{first:.1f}", str(ops)])


# 3. Dispatch overhead ----------------------------------------------------------------------


def paired_median(ours: Callable, direct: Callable, inputs, calls: int) -> tuple[float, ...]:
    """(median ours s, median direct s, median of per-pair ratios ours/direct), forward."""
    pairs = []
    with torch.no_grad():
        for _ in range(3):  # warm-up (and compilation)
            ours(*inputs), direct(*inputs)
        for _ in range(calls):
            t0 = time.perf_counter()
            ours(*inputs)
            t1 = time.perf_counter()
            direct(*inputs)
            pairs.append((t1 - t0, time.perf_counter() - t1))
    return (statistics.median(a for a, _ in pairs), statistics.median(b for _, b in pairs),
            statistics.median(a / b for a, b in pairs))


def dispatch_report(sizes: list[int], calls: int, backend: str) -> None:
    print(f"\n3. Dispatch overhead: qkv.attention(mask=qkv.causal()) -> SDPA versus SDPA "
          f"directly (is_causal=True), forward, B={B} H={H} D={D}; median of {calls} "
          f"alternating pairs; compiled with {backend}; target overhead <= 5%")
    print_header(["N", "sdpa us", "qkv us", "overhead", "compiled sdpa us", "compiled qkv us",
                  "compiled overhead"])

    def ours(q, k, v):
        return qkv.attention(q, k, v, mask=qkv.causal())

    def direct(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    for n in sizes:
        gen = torch.Generator().manual_seed(n)
        inputs = [torch.randn(B, H, n, D, generator=gen) for _ in range(3)]
        e_ours, e_direct, e_ratio = paired_median(ours, direct, inputs, calls)
        torch._dynamo.reset()
        c_ours, c_direct = (torch.compile(f, backend=backend, fullgraph=True, dynamic=False)
                            for f in (ours, direct))
        k_ours, k_direct, k_ratio = paired_median(c_ours, c_direct, inputs, calls)
        print_row([str(n), f"{e_direct * 1e6:.0f}", f"{e_ours * 1e6:.0f}",
                   f"{(e_ratio - 1) * 100:+.1f}%", f"{k_direct * 1e6:.0f}",
                   f"{k_ours * 1e6:.0f}", f"{(k_ratio - 1) * 100:+.1f}%"])


# -------------------------------------------------------------------------------------------


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", type=int, nargs="+", default=[1, 2, 3],
                        choices=[1, 2, 3], help="which tables to print")
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384],
                        help="sequence lengths of table 1")
    parser.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per cell of table 1")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: N=512, short GPT context, few dispatch calls")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--peak-of", nargs=3, metavar=("VARIANT", "N", "MODE"),
                        help=argparse.SUPPRESS)  # the child process of peak_in_child
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.recompile_limit = 64
    if args.peak_of:
        variant, n, mode = args.peak_of
        _peak_of(variant, int(n), mode, args.backend)
        return
    sizes = [512] if args.quick else args.sizes
    print(f"qkv torch.compile benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"torch {torch.__version__}, {_cpu_model()}, {os.cpu_count()} CPUs, threads "
          f"{torch.get_num_threads()}, backend {args.backend}, load average "
          f"{os.getloadavg()[0]:.1f} (other load on the CPUs distorts every figure)")
    if 1 in args.sections:
        attention_report(sizes, 1 if args.quick else args.repeat, args.backend)
    if 2 in args.sections:
        if args.quick:
            gpt_report(block=128, batch=2, steps=3, rounds=2, backend=args.backend)
        else:
            gpt_report(block=512, batch=4, steps=5, rounds=4, backend=args.backend)
    if 3 in args.sections:
        dispatch_report([128, 1024], 20 if args.quick else 200, args.backend)


if __name__ == "__main__":
    main()
