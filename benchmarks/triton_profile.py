"""Where the Triton engine's time goes on a GPU, in one run (bf16, dot, B·N = 16k):

1. per call, for qkv's Triton engine, compiled FlexAttention and SDPA (plain and causal,
   forward and forward+backward): the time of one synchronized call, the time per call of
   calls queued back to back (host time hidden behind the GPU's), and the device time of
   each kernel (torch.profiler), so that host overhead is told from kernel time;
2. a bare FlashAttention-2 forward with the engine's forward tiles, and the same with one of
   the engine's extra steps switched on at a time, to find which of them costs time;
3. host time per call, the GPU kept busy so that no call waits for it: qkv.attention against
   the launch of its forward kernel alone (Triton's share), SDPA and FlexAttention.

    python benchmarks/triton_profile.py --d 128 --n 8192 --heads 16

The figures also go to benchmarks/results/gpu-profile-<date>-<device>.json (with the qkv
source that ran, for benchmarks/gpu_suite.sh's runs on an older tree).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.profiler import ProfilerActivity, profile

import qkv
from qkv.engines.triton.function import choose_tiling
from results import write_results  # beside this script


@triton.jit
def _tile(pointers, ok, MASKED: tl.constexpr):
    if MASKED:
        x = tl.load(pointers, mask=ok, other=0.0)
    else:
        x = tl.load(pointers)
    return x


@triton.jit
def bare_forward(Q, K, V, O, qk_scale, N, stride, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 D: tl.constexpr, MASKED: tl.constexpr, ACC_ADD: tl.constexpr,
                 V_FIRST: tl.constexpr, SAFE_MAX: tl.constexpr):
    """Plain attention, (B·H, N, D) contiguous, N a multiple of both blocks. The switches add
    what the engine's forward does: MASKED row and column masks on every key load, ACC_ADD the
    product added to the rescaled accumulator (not accumulated into it), V_FIRST v loaded
    before the scores, SAFE_MAX the max guarded against rows with no key."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    base = tl.program_id(1).to(tl.int64) * N * stride
    q = tl.load(Q + base + rows[:, None] * stride + offs_d[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(0, N, BLOCK_N):
        keys = tl.multiple_of(start, BLOCK_N) + tl.arange(0, BLOCK_N)
        ok = (keys[:, None] < N) & (offs_d[None, :] < D)
        at = base + keys[:, None] * stride + offs_d[None, :]
        if V_FIRST:
            v = _tile(V + at, ok, MASKED)
        k = _tile(K + at, ok, MASKED)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if SAFE_MAX:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if not V_FIRST:
            v = _tile(V + at, ok, MASKED)
        if ACC_ADD:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        else:
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(O + base + rows[:, None] * stride + offs_d[None, :], out.to(O.dtype.element_ty))


BARE = {
    "bare": {},
    "+ masked loads": {"MASKED": True},
    "+ product added to acc": {"ACC_ADD": True},
    "+ v loaded first": {"V_FIRST": True},
    "+ guarded max": {"SAFE_MAX": True},
    "+ all four (the engine's loop before 2026-11-27)": {
        "MASKED": True, "ACC_ADD": True, "V_FIRST": True, "SAFE_MAX": True},
}


PARTS = ("qkv", "flex", "sdpa", "bare", "host")


def _bare(q, k, v, switches):
    t = choose_tiling(0, q.shape[-1], True).fwd
    out = torch.empty_like(q)
    flags = {"MASKED": False, "ACC_ADD": False, "V_FIRST": False, "SAFE_MAX": False, **switches}
    bare_forward[(q.shape[2] // t.block_m, q.shape[0] * q.shape[1])](
        q, k, v, out, q.shape[-1] ** -0.5 * 1.4426950408889634, q.shape[2], q.stride(2),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, D=q.shape[-1], num_warps=t.num_warps,
        num_stages=t.num_stages, **flags)
    return out


def _events():
    return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)


def synced_ms(fn, reps: int = 10) -> float:
    """Median of single calls, each waited for: host time before the launch counts."""
    start, end = _events()
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def queued_ms(fn, reps: int = 10) -> float:
    """Per call, ``reps`` calls queued back to back: host time hides behind the GPU's."""
    start, end = _events()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def kernel_ms(fn, reps: int = 5) -> dict[str, float]:
    """Device time per call of each kernel (ms), from the profiler."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us:
            times[e.key] += us / 1e3 / reps
    return dict(times)


def host_us(fn, reps: int = 50) -> float:
    """Host time per call (µs), queued behind ~130 ms of products so that no call waits for
    the GPU (a call that synchronizes shows as tens of milliseconds). 50 calls: with 20, one
    slow call moved a row by tens of µs (2026-11-27: causal dispatch 94 against plain 47 µs,
    where the CPU shows 4 µs between them)."""
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(80):
        busy @ busy
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / reps * 1e6


def forward_launch(q, k, v, mask):
    """The launch of qkv's forward kernel alone, replayed with the arguments of one call."""
    from qkv.engines.triton import kernels

    real, launches = kernels.fwd_kernel, []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append((grid, args, kwargs))
                return real[grid](*args, **kwargs)
            return launch

    kernels.fwd_kernel = Recorder()
    try:
        qkv.attention(q, k, v, mask=mask, backend="triton")
    finally:
        kernels.fwd_kernel = real
    grid, args, kwargs = launches[0]
    return lambda: real[grid](*args, **kwargs)


def host_table(q, k, v, leaves, dout, flex) -> list[dict]:
    print("\n| call (host only, GPU busy) | causal | µs per call |")
    print("|---|---|---|")
    rows = []
    for causal in (False, True):
        mask = qkv.causal() if causal else None
        with torch.no_grad():
            launch = forward_launch(q, k, v, mask)
        calls = {
            "qkv.attention, triton, fwd": lambda m=mask: qkv.attention(q, k, v, mask=m,
                                                                       backend="triton"),
            "its fwd_kernel launch alone": launch,
            "qkv.attention, triton, fwd+bwd": lambda m=mask: torch.autograd.grad(
                qkv.attention(*leaves, mask=m, backend="triton"), leaves, dout),
            "qkv.attention, auto (SDPA), fwd": lambda m=mask: qkv.attention(q, k, v, mask=m),
            "sdpa, fwd": lambda c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
        }
        if not causal:
            calls["flex (compiled), fwd"] = lambda: flex(q, k, v)
        for name, fn in calls.items():
            try:
                with torch.no_grad() if "bwd" not in name else torch.enable_grad():
                    fn()
                    us = host_us(fn)
                print(f"| {name} | {causal} | {us:.0f} |", flush=True)
                rows.append({"table": "host", "call": name, "causal": causal,
                             "host_us": round(us, 1)})
            except Exception as e:
                print(f"| {name} | {causal} | {type(e).__name__}: {str(e)[:80]} |")
    return rows


def compiled_flex():
    """torch.compile(flex_attention), allowed a recompile per variant a run times."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = 64
    return torch.compile(flex_attention, dynamic=False)


def problem(n: int, heads: int, d: int):
    """q, k, v (B, H, N, D) bf16 on the GPU with B·N = 16k, a gradient of the output, and
    q, k, v again as leaves that require grad."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(max(1, 16384 // n), heads, n, d, device="cuda", generator=g,
                           dtype=torch.bfloat16) for _ in range(3))
    return q, k, v, torch.randn_like(q), [t.detach().requires_grad_() for t in (q, k, v)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {', '.join(PARTS)}")
    args = parser.parse_args()
    wanted = set(args.parts.split(","))
    unknown = wanted - set(PARTS)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; expected {', '.join(PARTS)}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (device times, the profiler); none is visible")
    from torch.nn.attention.flex_attention import create_block_mask

    flex, (q, k, v, dout, leaves) = compiled_flex(), problem(args.n, args.heads, args.d)
    batch = q.shape[0]
    pairs = batch * args.heads * args.n**2
    print(f"{torch.cuda.get_device_name()}, bf16, B={batch} H={args.heads} N={args.n} "
          f"D={args.d}\n")
    print("| system | causal | pass | synced ms | queued ms | kernels ms | TFLOP/s (kernels) "
          "| kernels (ms each) |")
    print("|---|---|---|---|---|---|---|---|")
    rows = []
    for causal in (False, True):
        block_mask = (create_block_mask(lambda b, h, i, j: j <= i, None, None, args.n, args.n)
                      if causal else None)
        systems = {
            "qkv triton": ("qkv", lambda *t, c=causal: qkv.attention(
                *t, mask=qkv.causal() if c else None, backend="triton")),
            "flex (compiled)": ("flex", lambda *t, m=block_mask: flex(*t, block_mask=m)),
            "sdpa": ("sdpa", lambda *t, c=causal: F.scaled_dot_product_attention(
                *t, is_causal=c)),
        }
        flops = 4.0 * pairs * args.d * (0.5 if causal else 1.0)
        for name, (key, fn) in systems.items():
            if key not in wanted:
                continue
            for pass_, call, fl in (
                ("fwd", lambda fn=fn: fn(q, k, v), flops),
                ("fwd+bwd", lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, dout),
                 3.5 * flops),
            ):
                try:
                    with torch.no_grad() if pass_ == "fwd" else torch.enable_grad():
                        for _ in range(3):
                            call()
                        synced, queued = synced_ms(call), queued_ms(call)
                        kernels = kernel_ms(call)
                except Exception as e:  # one system failing must not hide the rest
                    print(f"| {name} | {causal} | {pass_} | {type(e).__name__}: {str(e)[:80]} "
                          "| | | | |")
                    continue
                total = sum(kernels.values())
                top = sorted(kernels.items(), key=lambda kv: -kv[1])[:4]
                listed = "; ".join(f"{key[:40]} {ms:.2f}" for key, ms in top)
                print(f"| {name} | {causal} | {pass_} | {synced:.2f} | {queued:.2f} | "
                      f"{total:.2f} | {fl / total / 1e9:.0f} | {listed} |", flush=True)
                rows.append({"table": "kernels", "system": name, "causal": causal,
                             "pass": pass_, "synced_ms": round(synced, 3),
                             "queued_ms": round(queued, 3), "kernels_ms": round(total, 3),
                             "tflops": round(fl / total / 1e9, 1),
                             "kernel_ms": {key: round(ms, 3) for key, ms in kernels.items()}})
    if "bare" in wanted:
        rows += bare_table(q, k, v, pairs * 4.0 * args.d)
    if "host" in wanted:
        rows += host_table(q, k, v, leaves, dout, flex)
    write_results("gpu-profile", rows, "cuda", dtype="bfloat16", B=batch, H=args.heads,
                  N=args.n, D=args.d)


def bare_table(q, k, v, flops) -> list[dict]:
    print("\n| bare FA-2 forward (the engine's forward tiles) | ms | TFLOP/s |")
    print("|---|---|---|")
    rows = []
    for name, switches in BARE.items():
        def call(switches=switches):
            return _bare(q, k, v, switches)
        try:
            call()
            ms = queued_ms(call, reps=20)
        except Exception as e:
            print(f"| {name} | {type(e).__name__}: {str(e)[:80]} | |")
            continue
        print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |", flush=True)
        rows.append({"table": "bare", "forward": name, "queued_ms": round(ms, 4),
                     "tflops": round(flops / ms / 1e9, 1)})
    return rows


if __name__ == "__main__":
    main()
