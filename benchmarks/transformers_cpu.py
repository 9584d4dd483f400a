"""transformers models on CPU: one training step (forward + backward) under eager, sdpa and
qkv attention (``attn_implementation``), time and extra peak memory, side by side.

A tiny Gemma 2 (softcap 50, global attention) and a tiny Llama: 1 layer, 4 heads of dim 16,
hidden 64, vocabulary 256, batch 1, fp32. Each (model, implementation, N) runs in a fresh
process: a warm-up step, the median time of ``--repeats`` steps, then the peak resident memory
above the level before one more step (large allocations forced onto mmap so that freed tensors
leave the resident set; see attention_cpu.peak_extra_memory). transformers refuses sdpa with
a softcap (Gemma 2): that cell says n/a.

    python benchmarks/transformers_cpu.py                       # N = 1024, 4096, 8192
    python benchmarks/transformers_cpu.py --models llama --lengths 1024 --repeats 9
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import torch

IMPLEMENTATIONS = ("eager", "sdpa", "qkv")
MODELS = ("gemma2", "llama")


def build(name: str):
    import transformers as tf

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                 max_position_embeddings=8192, attn_implementation="eager")
    if name == "gemma2":
        config = tf.Gemma2Config(**shape, attn_logit_softcapping=50.0,
                                 layer_types=["full_attention"], query_pre_attn_scalar=16)
        return tf.Gemma2ForCausalLM(config)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**shape))


def child(name: str, implementation: str, n: int, repeats: int) -> dict:
    """Time (s) and extra peak memory (bytes) of one training step, in this process."""
    from attention_cpu import peak_extra_memory
    from qkv.integrations.transformers import register

    register()
    torch.manual_seed(0)
    model = build(name)
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, 256, (1, n))

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    try:
        step()
    except ValueError as e:  # sdpa with a softcap
        return {"error": str(e).splitlines()[0]}
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return {"time": statistics.median(times), "memory": peak_extra_memory(step)}


def measure(name: str, implementation: str, n: int, repeats: int) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--child", name, implementation, str(n), "--repeats",
         str(repeats)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--child", nargs=3, metavar=("MODEL", "IMPL", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        name, implementation, n = args.child
        print(json.dumps(child(name, implementation, int(n), args.repeats)))
        return 0
    import transformers

    print(f"# torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"fp32, batch 1, 1 layer, 4 heads x 16, training step (forward + backward)")
    print("| model | N | eager s | sdpa s | qkv s | qkv/eager time | qkv/sdpa time "
          "| eager MiB | sdpa MiB | qkv MiB | qkv/eager memory |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        for n in (int(x) for x in args.lengths.split(",")):
            r = {impl: measure(name, impl, n, args.repeats) for impl in IMPLEMENTATIONS}

            def cell(impl, key, scale=1.0, r=r):
                value = r[impl].get(key)
                return "n/a" if value is None else f"{value / scale:.{2 if scale == 1 else 0}f}"

            def ratio(key, impl, r=r):
                a, b = r["qkv"].get(key), r[impl].get(key)
                return "n/a" if a is None or b is None else f"{a / b:.2f}"

            mib = 2 ** 20
            print(f"| {name} | {n} | {cell('eager', 'time')} | {cell('sdpa', 'time')} | "
                  f"{cell('qkv', 'time')} | {ratio('time', 'eager')} | {ratio('time', 'sdpa')} | "
                  f"{cell('eager', 'memory', mib)} | {cell('sdpa', 'memory', mib)} | "
                  f"{cell('qkv', 'memory', mib)} | {ratio('memory', 'eager')} |", flush=True)
            for impl in IMPLEMENTATIONS:
                if "error" in r[impl] and not (name == "gemma2" and impl == "sdpa"):
                    print(f"# {name} {impl} N={n}: {r[impl]['error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
