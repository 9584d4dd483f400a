"""``qkv train | eval | generate | translate | export RUN_DIR``: the subcommands on run
directories (``qkv eval`` and ``qkv generate`` hand ``--model NAME_OR_PATH`` to
``qkv.model_commands``).

Each subcommand is an ``add_*_arguments`` function that declares its arguments and a ``run_*``
function that runs it; ``qkv.cli.COMMANDS`` pairs them with their help and examples.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_model

from . import model_commands, threads
from .data.atomic import write_atomic
from .train import distributed, run
from .train.rundir import load_run


# ----------------------------------------------------------------------------- train
def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", choices=["translate", "lm", "vit"], help="what to train")
    p.add_argument("--run-dir", help="where the run lives (default: runs/TASK-DATE-TIME)")
    p.add_argument("--preset", default="default", help="a named configuration: default or tiny")
    p.add_argument("--config", help="a TOML or JSON file with [data] [model] [train] [eval]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. train.steps=500 (repeatable)")
    p.add_argument("--init", metavar="NAME_OR_PATH",
                   help="lm: start from a pretrained checkpoint's weights and tokenizer "
                        "(smollm2, a GPT-2 / LLaMA directory, a .gguf file)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --run-dir from its newest intact checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress output")


def run_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.threads:  # the run's train.threads, stored with the rest of its configuration
        overrides.append(f"train.threads={args.threads}")
    if args.init:
        overrides.append(f"train.init={json.dumps(args.init)}")
    # A new run's default directory; a resumed one names its own.
    run_dir = args.run_dir or (None if args.resume else
                               f"runs/{args.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    result = run.train(run.RunRequest(args.task, run_dir and Path(run_dir), args.preset,
                                      args.config, tuple(overrides), args.resume, args.quiet))
    if result.is_main:
        task = run.get_task(args.task)
        print(f"run directory: {result.run_dir}")
        print(result.time_line())
        print(task.summary(result.evaluation))
        from .viz.heatmap import cross_attention_png  # matplotlib, an optional dependency

        task.report(result.model, result.data, result.config, result.run_dir, sys.stdout,
                    heatmap=cross_attention_png)
    distributed.teardown()
    return 0


# ----------------------------------------------------------------------------- eval
def add_run_dir(p: argparse.ArgumentParser, or_model: bool = False) -> None:
    if not or_model:
        p.add_argument("run_dir", help="a run directory written by `qkv train`")
        return
    p.add_argument("run_dir", nargs="?", help="a run directory written by `qkv train` "
                   "(or give --model instead)")
    model_commands.add_model_option(p)


def run_dir_or_model(args: argparse.Namespace, command: str) -> bool:
    """True when the command runs on --model; exactly one of RUN_DIR and --model is given."""
    if (args.run_dir is None) == (args.model is None):
        raise ValueError(f"`qkv {command}` takes a run directory or --model NAME_OR_PATH "
                         "(exactly one)")
    return args.model is not None


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    add_run_dir(p, or_model=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one eval.* key of the run, e.g. eval.beam_size=4 (repeatable)")
    p.add_argument("--text", metavar="FILE", help="--model: the UTF-8 text to score "
                   "(default: the held-out standard-library docstrings)")
    p.add_argument("--window", type=int, help="--model: tokens per scored window "
                   "(default: the context, at most 1024)")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="--model: score at most this many tokens (default 0: all)")


def eval_overrides(args: argparse.Namespace, flags: tuple[str, ...]) -> list[str]:
    """``eval.NAME=VALUE`` for each flag in ``flags`` that was given (a flag is named after its
    eval key), so flags and ``--set`` go through the same config checks."""
    return [f"eval.{name}={getattr(args, name)!r}" for name in flags
            if getattr(args, name) is not None]


def run_eval(args: argparse.Namespace) -> int:
    if run_dir_or_model(args, "eval"):
        if args.overrides:
            raise ValueError("--set applies to run directories; with --model use --text, "
                             "--window and --max-tokens")
        return model_commands.run_eval(args)
    task, cfg, data, model = run.load(args.run_dir, overrides=args.overrides)
    threads.configure(args.threads)
    with torch.no_grad():
        result = task.evaluate(model, data, cfg, final=True)
    print(task.summary(result))
    return 0


# ----------------------------------------------------------------------------- generate
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    add_run_dir(p, or_model=True)
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, help="default: the run's eval.max_new_tokens")
    p.add_argument("--temperature", type=float, help="0 is greedy; default eval.temperature")
    p.add_argument("--top-k", type=int, help="sample from the k likeliest (0: all); eval.top_k")
    p.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1]; eval.top_p")
    p.add_argument("--beam-size", type=int, help="> 1: beam search; default eval.beam_size")
    p.add_argument("--seed", type=int, default=0)
    model_commands.add_weights_option(p)


GENERATE_FLAGS = ("max_new_tokens", "temperature", "top_k", "top_p", "beam_size")
# --model has no run config to take defaults from: greedy, 64 tokens.
MODEL_GENERATE_DEFAULTS = {"max_new_tokens": 64, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                           "beam_size": 1}


def run_generate(args: argparse.Namespace) -> int:
    if run_dir_or_model(args, "generate"):
        for flag, default in MODEL_GENERATE_DEFAULTS.items():
            if getattr(args, flag) is None:
                setattr(args, flag, default)
        return model_commands.run_generate(args)
    if args.weights != "fp32":
        raise ValueError("--weights applies to --model checkpoints, not to run directories")
    model_commands.check_seed(args.seed)

    task, cfg, data, model = run.load(args.run_dir, task="lm",
                                      overrides=eval_overrides(args, GENERATE_FLAGS))
    threads.configure(args.threads)
    write = model_commands.write
    write(args.prompt)
    try:  # the text streams; after Ctrl-C, what was printed stays, ended by a newline
        task.generate(model, data, cfg, args.prompt, seed=args.seed, write=write)
    finally:
        write("\n")
    return 0


# ----------------------------------------------------------------------------- translate
def add_translate_arguments(p: argparse.ArgumentParser) -> None:
    add_run_dir(p)
    p.add_argument("text", nargs="+",
                   help="one or more sentences to translate; - reads one per line from stdin")
    p.add_argument("--beam-size", type=int, help="default: the run's eval.beam_size; 1 is greedy")
    p.add_argument("--heatmap", help="also write the first sentence's cross-attention PNG here")


def screen_sources(texts: list[str], tok, from_stdin: bool) -> list[bool]:
    """Which texts to translate. An empty text, or one made only of characters the model never
    saw (that the tokenizer reads as <unk>), is refused (an argument: one error line) or
    skipped with a line on stderr (a line of standard input: its output line is left empty);
    unknown characters in a text that has known ones are named on stderr."""
    keep = []
    for i, text in enumerate(texts, 1):
        where = f"line {i}" if from_stdin else f"text {i}"
        chars = list(dict.fromkeys(ch for ch in text if not ch.isspace()))
        unknown = [ch for ch in chars if tok.unk_id in tok.encode(ch)]
        shown = ", ".join(repr(ch) for ch in unknown[:5])
        if len(unknown) == len(chars):
            why = f"has no character the model knows ({shown})" if chars else "is empty"
            if not from_stdin:
                raise ValueError(f"{where} {why}; nothing to translate")
            print(f"qkv: {where} {why}; its output line is left empty", file=sys.stderr)
            keep.append(False)
            continue
        if unknown:
            print(f"qkv: warning: {where} has characters the model never saw ({shown}); they "
                  "are read as <unk> and the translation may be wrong", file=sys.stderr)
        keep.append(True)
    return keep


def run_translate(args: argparse.Namespace) -> int:
    texts = args.text
    from_stdin = texts == ["-"]
    if from_stdin:
        texts = sys.stdin.read().splitlines()
        if not texts:
            raise ValueError("`qkv translate RUN -` found no lines on standard input")
    task, cfg, data, model = run.load(args.run_dir, task="translate",
                                      overrides=eval_overrides(args, ("beam_size",)))
    keep = screen_sources(texts, data.src_tok, from_stdin)
    threads.configure(args.threads)
    kept = [t for t, k in zip(texts, keep, strict=True) if k]
    translated = iter(task.translate(model, data, cfg, kept, cfg.eval.beam_size) if kept else [])
    outputs = [next(translated) if k else "" for k in keep]
    for text in outputs:
        print(text)
    if args.heatmap and kept:
        from .viz.heatmap import cross_attention_png  # matplotlib, an optional dependency

        cross_attention_png(model, data.src_tok, data.tgt_tok, kept[0], outputs[keep.index(True)],
                            args.heatmap)
        print(f"cross-attention heatmap: {args.heatmap}", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- export
def add_export_arguments(p: argparse.ArgumentParser) -> None:
    add_run_dir(p)
    p.add_argument("-o", "--output", required=True, help="the .safetensors file to write")


def run_export(args: argparse.Namespace) -> int:
    """The run's newest weights (a sharded checkpoint read in this one process, or a plain
    one) as one safetensors file, written atomically."""
    model = load_run(args.run_dir).model
    write_atomic(args.output, lambda path: save_model(model, path))
    print(f"wrote {args.output}", file=sys.stderr)
    return 0
