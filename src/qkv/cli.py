"""The ``qkv`` command: train, eval, generate, chat, embed, translate, viz, lab, bench.

Each subcommand is one ``Command`` in ``COMMANDS`` (its arguments, its run function, its
examples); adding a command means adding one entry. Bad input (a missing data file, an
unknown config key, a run directory without a checkpoint, ...) prints one line and exits 2;
set QKV_DEBUG=1 to see the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import __version__, chat, model_commands, run_commands, threads
from .lab import command as lab_command
from .viz import command as viz_command

USAGE_ERROR = 2
SIGPIPE_EXIT = 128 + 13  # the status a shell reports for a process killed by SIGPIPE


@dataclass
class Command:
    help: str
    examples: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# ----------------------------------------------------------------------------- viz
def add_viz_arguments(p: argparse.ArgumentParser) -> None:
    viz_command.add_arguments(p)


def run_viz(args: argparse.Namespace) -> int:
    return viz_command.run(args)


# ----------------------------------------------------------------------------- bench
BENCHMARKS = {"attention": "attention_cpu.py", "generate": "generate_cpu.py",
              "train": "train_cpu.py"}
BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"  # src/qkv/cli.py -> repo root


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark script")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed on to the script")


def run_bench(args: argparse.Namespace) -> int:
    """Run ``benchmarks/<script>``'s ``main(argv)`` from the source checkout qkv runs from."""
    script = BENCH_DIR / BENCHMARKS[args.name]
    if not script.is_file():
        raise FileNotFoundError(f"`qkv bench` needs a source checkout; {script} is missing")
    threads.configure(args.threads)  # a script's own --threads, where it has one, comes after
    if str(BENCH_DIR) not in sys.path:  # the scripts import results.py from beside them
        sys.path.insert(0, str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location(f"qkv_bench_{args.name}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    try:
        spec.loader.exec_module(module)
        return module.main(args.bench_args) or 0
    except ModuleNotFoundError as e:  # make demo installs qkv[train]; the references are dev's
        raise ImportError(f"`qkv bench {args.name}` needs the {e.name!r} package, which "
                          "`make test` installs (pip install -e '.[dev]')") from e


COMMANDS: dict[str, Command] = {
    "train": Command(
        "train a model on its embedded data set or on your files",
        "  qkv train translate                      # German->English numbers, the demo model\n"
        "  qkv train lm --set train.steps=500       # char-level GPT on stdlib docstrings\n"
        "  qkv train vit --run-dir runs/digits      # ViT on scikit-learn's digits\n"
        "  qkv train translate --set data.path=pairs.tsv --config my.toml\n"
        "  qkv train lm --run-dir runs/x --resume   # continue after a crash\n"
        "  torchrun --nproc_per_node=2 $(which qkv) train lm   # DDP (gloo on CPU)",
        run_commands.add_train_arguments, run_commands.run_train,
    ),
    "eval": Command(
        "evaluate a run's newest checkpoint on its held-out data, or a checkpoint's perplexity",
        "  qkv eval runs/translate-20260101-120000\n  qkv eval runs/digits\n"
        "  qkv eval --model smollm2 --text notes.txt       # perplexity\n"
        "  qkv eval runs/demo --set eval.beam_size=8 --set eval.length_penalty=1.0",
        run_commands.add_eval_arguments, run_commands.run_eval,
    ),
    "generate": Command(
        "continue a prompt with a trained lm run or a pretrained checkpoint",
        '  qkv generate runs/lm --prompt "Return the"\n'
        '  qkv generate --model smollm2 --prompt "The capital of France is"\n'
        '  qkv generate runs/lm --prompt "def " --max-new-tokens 300 --temperature 0.5\n'
        '  qkv generate runs/lm --prompt "The " --top-k 20 --top-p 0.9\n'
        '  qkv generate runs/lm --prompt "The " --beam-size 4',
        run_commands.add_generate_arguments, run_commands.run_generate,
    ),
    "chat": Command(
        "talk with a pretrained chat model (its chat template; replies stream as they come)",
        "  qkv chat --model smollm2\n"
        '  qkv chat --model smollm2 --message "What is attention?" --max-new-tokens 100\n'
        '  qkv chat --model smollm2 --system "Answer in one line." --temperature 0.7',
        chat.add_arguments, chat.run,
    ),
    "embed": Command(
        "sentence embeddings of a pretrained encoder: cosine similarities, or the vectors",
        '  qkv embed --model minilm "A man eats food." "Someone is eating." "A cat sleeps."\n'
        '  qkv embed --model minilm --json "one sentence" > vectors.json\n'
        "  qkv embed --model minilm - < sentences.txt",
        model_commands.add_embed_arguments, model_commands.run_embed,
    ),
    "translate": Command(
        "translate text with a trained translate run (beam search by default)",
        '  qkv translate runs/demo "zweiundvierzig"\n'
        '  qkv translate runs/demo "dreihundertzwölf" "elf" --beam-size 1 --heatmap a.png\n'
        "  qkv translate runs/demo - < german.txt      # one sentence per line",
        run_commands.add_translate_arguments, run_commands.run_translate,
    ),
    "viz": Command(
        "write an interactive attention page (and pictures) for a run or a pretrained model",
        '  qkv viz runs/lm --text "Return the" -o attention.html\n'
        '  qkv viz runs/demo --text "zweiundvierzig" --png pictures/\n'
        "  qkv viz runs/digits --image 3 --layers 0,-1 --heads 0\n"
        '  qkv viz --model smollm2 --chat --text "Name three colours." --generate 12\n'
        '  qkv viz --model minilm --text "The cat sat on the mat."',
        add_viz_arguments, run_viz,
    ),
    "export": Command(
        "write a run's newest weights (sharded by train.fsdp or not) to one safetensors file",
        "  qkv export runs/lm -o model.safetensors",
        run_commands.add_export_arguments, run_commands.run_export,
    ),
    "lab": Command(
        "train variants of a model over seeds and compare them with the baseline",
        "  qkv lab examples/lab/extensions.toml -o labs/extensions\n"
        "  qkv lab my.toml -o labs/mine --jobs 2 --threads 1   # 2 runs at a time, 1 thread each",
        lab_command.add_arguments, lab_command.run,
    ),
    "bench": Command(
        "run a benchmark script from the source checkout",
        "  qkv bench attention\n  qkv bench train",
        add_bench_arguments, run_bench,
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkv", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="The attention mechanism and the Transformer, from one command.\n\n"
                    + threads.SUMMARY,
        epilog="examples:\n" + "\n".join(c.examples.splitlines()[0] for c in COMMANDS.values()),
    )
    parser.add_argument("--version", action="version", version=f"qkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.help, description=command.help,
                           epilog="examples:\n" + command.examples,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        command.add_arguments(p)
        threads.add_option(p)
        p.set_defaults(run=command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.threads = threads.parse(args.threads)
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader stopped (`qkv embed ... | head`): stop quietly, as a Unix tool killed by
        # SIGPIPE does. stdout goes to /dev/null so that the exit's flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_EXIT
    except (ValueError, OSError, ImportError) as e:
        if os.environ.get("QKV_DEBUG"):
            raise
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"qkv: error: {message}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt as e:
        # Training says what it saved and how to resume (qkv.train.interrupt.Interrupted).
        print(f"qkv: {str(e) or 'interrupted'}", file=sys.stderr)
        return getattr(e, "exit_code", 130)


if __name__ == "__main__":
    sys.exit(main())
