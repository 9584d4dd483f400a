"""``qkv generate | embed | eval --model NAME_OR_PATH``: pretrained checkpoints (``qkv chat``
is ``qkv.chat``).

NAME_OR_PATH is a short name (``smollm2``, ``minilm``), a GPT-2 / LLaMA / BERT directory, or a
``.gguf`` file (see ``qkv.models.load_pretrained``).
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from . import models, threads
from .data.docstrings import stdlib_docstrings
from .data.text import read_text_file, split_text
from .models import GPT
from .models.pretrained.usage import TextStream, cosine_matrix, embed_texts
from .models.scoring import perplexity, token_nll
from .nn.packed import pack_linears

MAX_SEED = 2**32 - 1  # what numpy's and torch's generators all accept (train.seed)
MODEL_HELP = ("a pretrained checkpoint: smollm2, minilm, a GPT-2 / LLaMA / BERT directory or "
              "a .gguf file")


def add_model_option(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--model", metavar="NAME_OR_PATH", required=required, help=MODEL_HELP)


def add_weights_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: weight-only bf16 linear layers, half the weight bytes: faster "
                        "decoding on CPU (SmolLM2 on a 2-core Zen 4: 1.4x fp32's rate at batch "
                        "1, 1.6x at batch 8), and bf16 attention products for the prompt on "
                        "AMD CPUs with AVX512-BF16; logits within about 2e-2 relative (default "
                        "fp32: exact)")


def load(name: str, want: str, command: str, weights: str = "fp32"):
    """(model, tokenizer) of checkpoint ``name``; ``want`` is "decoder" or "encoder";
    ``weights`` "bf16" packs the linear layers (``qkv.nn.packed``)."""
    model, tokenizer = models.load_pretrained(name)
    if (want == "decoder") != isinstance(model, GPT):
        other = "qkv embed" if want == "decoder" else "qkv generate"
        article = "an" if want == "encoder" else "a"
        raise ValueError(f"`{command}` needs {article} {want} checkpoint; {name!r} is not one "
                         f"(try `{other}`)")
    if tokenizer is None:
        raise ValueError(f"{name!r} has no tokenizer (tokenizer.json); `{command}` needs one")
    return (pack_linears(model) if weights == "bf16" else model), tokenizer


def check_sampling_flags(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1; got {args.max_new_tokens}")
    if not 0 <= args.temperature < math.inf:  # NaN fails every comparison
        raise ValueError(f"--temperature must be a finite number >= 0 (0 = greedy); got "
                         f"{args.temperature}")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0 (0 = no top-k filter); got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1]; got {args.top_p}")
    if args.beam_size < 1:
        raise ValueError(f"--beam-size must be >= 1; got {args.beam_size}")
    check_seed(args.seed)


def check_seed(seed: int) -> None:
    """--seed within what every generator accepts (train.seed's range)."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"--seed must be in [0, {MAX_SEED}]; got {seed}")


def _generate(model, tokenizer, ids: list[int], args, write=None) -> list[int]:
    """Continue ``ids``; with ``write``, text is streamed to it as tokens arrive."""
    if len(ids) + args.max_new_tokens > model.config.block_size:
        raise ValueError(f"prompt ({len(ids)} tokens) + --max-new-tokens "
                         f"({args.max_new_tokens}) exceeds the model's context of "
                         f"{model.config.block_size} tokens")
    stream = TextStream(tokenizer, write) if write is not None and args.beam_size == 1 else None
    out = model.generate(
        torch.tensor([ids]), args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k or None, top_p=args.top_p if args.top_p < 1 else None,
        eos_id=tokenizer.eos_id, beam_size=args.beam_size, on_token=stream,
        generator=torch.Generator().manual_seed(args.seed),
    )[0, len(ids):].tolist()
    if tokenizer.eos_id in out:
        out = out[:out.index(tokenizer.eos_id)]
    if write is not None and stream is None:
        write(tokenizer.decode(out))
    return out


def write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def run_generate(args: argparse.Namespace) -> int:
    """Continue --prompt with a pretrained decoder, streaming the text."""
    check_sampling_flags(args)
    if not args.prompt:
        raise ValueError("--prompt is empty; give the text to continue")
    threads.configure(args.threads)
    model, tokenizer = load(args.model, "decoder", "qkv generate", args.weights)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        raise ValueError("--prompt is empty after tokenization")
    write(args.prompt)
    try:  # after Ctrl-C, what was printed stays, ended by a newline
        _generate(model, tokenizer, ids, args, write)
    finally:
        write("\n")
    return 0


def add_sampling_arguments(p, max_new_tokens: int, temperature: float) -> None:
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"default {max_new_tokens}")
    p.add_argument("--temperature", type=float, default=temperature,
                   help=f"0 is greedy (default {temperature})")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass in (0, 1] (default 1)")
    p.add_argument("--beam-size", type=int, default=1, help="> 1: beam search (no streaming)")
    p.add_argument("--seed", type=int, default=0)
    add_weights_option(p)


def add_embed_arguments(p: argparse.ArgumentParser) -> None:
    add_model_option(p, required=True)
    p.add_argument("text", nargs="+", help="sentences to embed; - reads one per line from stdin")
    p.add_argument("--json", action="store_true",
                   help="print the vectors as JSON instead of the cosine-similarity matrix")


def run_embed(args: argparse.Namespace) -> int:
    """Sentence embeddings: the cosine-similarity matrix, or the vectors as JSON."""
    texts = [line.rstrip("\n") for line in sys.stdin if line.strip()] if args.text == ["-"] \
        else args.text
    if not texts:
        raise ValueError("no text to embed (standard input was empty)")
    threads.configure(args.threads)
    model, tokenizer = load(args.model, "encoder", "qkv embed")
    vectors = embed_texts(model, tokenizer, texts)
    if args.json:
        print(json.dumps([{"text": t, "embedding": [round(x, 7) for x in v.tolist()]}
                          for t, v in zip(texts, vectors, strict=True)]))
        return 0
    sims = cosine_matrix(vectors)
    labels = [t if len(t) <= 40 else t[:37] + "..." for t in texts]
    width = max(len(label) for label in labels)
    print(" " * (width + 2) + " ".join(f"{i:>6}" for i in range(len(texts))))
    for i, label in enumerate(labels):
        print(f"{label:<{width}}  " + " ".join(f"{float(s):6.3f}" for s in sims[i])
              + f"   [{i}]")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    """Perplexity of a pretrained decoder on --text FILE (default: held-out stdlib docstrings)."""
    if args.window is not None and args.window < 2:  # before the slow load
        raise ValueError(f"--window must be at least 2 tokens; got {args.window}")
    if args.max_tokens < 0:
        raise ValueError(f"--max-tokens must be >= 0 (0: all); got {args.max_tokens}")
    threads.configure(args.threads)
    model, tokenizer = load(args.model, "decoder", "qkv eval")
    if args.text:
        text, source = read_text_file(args.text), args.text
    else:
        text, source = split_text(stdlib_docstrings(), 0.1)[1], "held-out stdlib docstrings"
    window = min(model.config.block_size, 1024) if args.window is None else args.window
    if not 2 <= window <= model.config.block_size:
        raise ValueError(f"--window must be in [2, {model.config.block_size}]; got {window}")
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
    if args.max_tokens:
        ids = ids[:args.max_tokens + 1]
    if len(ids) < 2:
        raise ValueError(f"{source}: fewer than 2 tokens to score")
    total, count = token_nll(model, ids, window, progress=True)
    print(f"{source}: {count} tokens in windows of {window}; mean NLL {total / count:.4f} "
          f"nats/token; perplexity {perplexity(total, count):.3f}")
    return 0
