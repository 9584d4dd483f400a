"""The Triton kernels' tile shapes on a GPU: forward and forward+backward TFLOP/s of plain and
causal dot attention for candidate tilings, side by side, with SDPA's fastest backend in the
same run (bf16, B·N = 16k).

The engine is not autotuned (its block tables are built for one tiling before launch), so
``function.choose_tiling`` is what this script replaces, one candidate at a time, beside SDPA
and compiled FlexAttention. Times are the kernels' device time per call (torch.profiler, as in
``triton_profile.py``): host time, which varies by ±0.3 ms a call, stays out of the choice.
``--flex-source FILE`` writes the Triton code Inductor generated for FlexAttention.

    python benchmarks/triton_tiling.py --d 128 --n 8192 --flex-source flex_kernels.py

The figures also go to benchmarks/results/gpu-tiling-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import glob
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

import qkv
from qkv.engines.triton import function
from qkv.engines.triton.function import Tiles, Tiling
from results import write_results  # beside this script
from triton_profile import compiled_flex, kernel_ms, problem

# (forward, dQ, dK/dV) as (block_m, block_n, num_warps, num_stages)
CANDIDATES = {
    "now": None,
    "dkv 64x64 w4 s3": (None, None, (64, 64, 4, 3)),
    "dkv 64x128 w8 s3": (None, None, (64, 128, 8, 3)),
    "dq 64x64 w4 s3": (None, (64, 64, 4, 3), None),
}


ORIGINAL = function.choose_tiling


def _patched(candidate):
    def choose(kernel, d_pad, on_gpu, element_bytes=2):
        now = ORIGINAL(kernel, d_pad, on_gpu, element_bytes)
        if candidate is None:
            return now
        fwd, dq, dkv = (now_t if c is None else Tiles(*c)
                        for c, now_t in zip(candidate, (now.fwd, now.dq, now.dkv), strict=True))
        return Tiling(fwd, dq, dkv, now.block_d)

    return choose


def _write_flex_source(cache: str, path: str) -> None:
    """Inductor's generated modules that hold a flex_attention template kernel, in one file."""
    files = sorted(glob.glob(f"{cache}/**/*.py", recursive=True))
    sources = {f: Path(f).read_text() for f in files}
    found = [f for f in files if "flex_attention" in sources[f]]
    with open(path, "w") as out:
        for f in found:
            out.write(f"# ==== {os.path.relpath(f, cache)}\n{sources[f]}\n")
    print(f"\n{len(found)} generated FlexAttention modules written to {path}")


def _device_ms(fn) -> tuple[float, dict[str, float]]:
    """Device time of one call (ms) after a warm-up, and each kernel's."""
    for _ in range(3):
        fn()
    kernels = kernel_ms(fn, reps=10)
    return sum(kernels.values()), kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--n", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--flex-source", metavar="FILE",
                        help="write the Triton code Inductor generated for FlexAttention")
    args = parser.parse_args()
    cache = None
    if args.flex_source:  # Inductor reads this when it first compiles
        cache = os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="flex_")
    from torch.nn.attention.flex_attention import create_block_mask

    flex, (q, k, v, dout, leaves) = compiled_flex(), problem(args.n, args.heads, args.d)
    batch = q.shape[0]
    flops = {False: 4.0 * batch * args.heads * args.n**2 * args.d}
    flops[True] = flops[False] / 2

    def tflops(fl, ms):
        return fl / ms / 1e9

    print(f"{torch.cuda.get_device_name()}, bf16, B={batch} H={args.heads} N={args.n} "
          f"D={args.d}\n")
    print("| tiling | causal | fwd TFLOP/s | fwd+bwd TFLOP/s | fwd ms | fwd+bwd ms "
          "| dK/dV ms | dQ ms |")
    print("|---|---|---|---|---|---|---|---|")
    results = []
    for causal in (False, True):
        def sdpa(*t, causal=causal):
            return F.scaled_dot_product_attention(*t, is_causal=causal)

        block_mask = (create_block_mask(lambda b, h, i, j: j <= i, None, None, args.n, args.n)
                      if causal else None)

        def flex_rows(*t, block_mask=block_mask):
            return flex(*t, block_mask=block_mask)

        rows = [("SDPA (its own choice)", sdpa), ("FlexAttention (compiled)", flex_rows)]
        for name in CANDIDATES:
            def ours(*t, causal=causal):
                return qkv.attention(*t, mask=qkv.causal() if causal else None,
                                     backend="triton")
            rows.append((name, ours))
        for name, fn in rows:
            function.choose_tiling = _patched(CANDIDATES.get(name))
            try:
                with torch.no_grad():
                    fwd, _ = _device_ms(lambda fn=fn: fn(q, k, v))
                both, kernels = _device_ms(
                    lambda fn=fn: torch.autograd.grad(fn(*leaves), leaves, dout))
            except Exception as e:  # a tiling that does not fit: say so, go on
                print(f"| {name} | {causal} | {type(e).__name__}: {str(e)[:60]} | | | | | |")
                continue
            dkv, dq = (sum(ms for key, ms in kernels.items() if key.startswith(kernel))
                       for kernel in ("bwd_kv_kernel", "bwd_q_kernel"))
            print(f"| {name} | {causal} | {tflops(flops[causal], fwd):.0f} | "
                  f"{tflops(3.5 * flops[causal], both):.0f} | {fwd:.2f} | {both:.2f} | "
                  f"{dkv:.2f} | {dq:.2f} |", flush=True)
            results.append({"tiling": name, "causal": causal, "fwd_ms": round(fwd, 3),
                            "fwd_bwd_ms": round(both, 3), "dkv_ms": round(dkv, 3),
                            "dq_ms": round(dq, 3),
                            "fwd_tflops": round(tflops(flops[causal], fwd), 1),
                            "fwd_bwd_tflops": round(tflops(3.5 * flops[causal], both), 1)})
    write_results("gpu-tiling", results, "cuda", dtype="bfloat16", B=batch, H=args.heads,
                  N=args.n, D=args.d)
    if cache is not None:
        _write_flex_source(cache, args.flex_source)


if __name__ == "__main__":
    main()
