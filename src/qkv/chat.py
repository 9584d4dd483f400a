"""``qkv chat --model NAME``: a conversation that behaves like the terminal programs people know.

- In a terminal, the prompt has line editing and history (the standard library's readline).
- Ctrl-C during a reply stops it; what was shown stays in the conversation, and the prompt
  returns. Ctrl-C at the prompt ends the chat if it follows another Ctrl-C, else says how to
  end it; Ctrl-D ends it.
- A reply cut off by --max-new-tokens says so; ``--stats`` prints tokens/s after each reply.
- Piped standard input (or ``--message``): one turn per non-blank line, no prompt.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

from . import threads
from .model_commands import (
    _generate,
    add_model_option,
    add_sampling_arguments,
    check_sampling_flags,
    load,
    write,
)

PROMPT = "you> "
HINT = "(Ctrl-C again or Ctrl-D ends the chat)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_option(p, required=True)
    p.add_argument("--system", help="a system message (default: the template's own)")
    p.add_argument("--message", action="append", default=[],
                   help="a user message to answer, then exit (repeatable: one turn each); "
                        "without it, turns are read from standard input")
    p.add_argument("--stats", action="store_true",
                   help="after each reply, print its tokens and tokens/s on standard error")
    add_sampling_arguments(p, max_new_tokens=256, temperature=0.0)


def note(text: str) -> None:
    """A line about the chat (not part of a reply), on standard error."""
    sys.stdout.flush()
    print(text, file=sys.stderr, flush=True)


def show(shown: list[str], text: str) -> None:
    """Write a piece of the reply and keep it (a reply stopped with Ctrl-C keeps what was
    shown)."""
    shown.append(text)
    write(text)


def piped_turns(args: argparse.Namespace):
    """--message turns, or one turn per non-blank line of standard input."""
    if args.message:
        yield from args.message
        return
    for line in sys.stdin:
        if line.strip():
            yield line.rstrip("\n")


def terminal_turns(state: dict):
    """Lines typed at the prompt, with readline's editing and history. ``state["stopped"]``
    is True when the last reply was stopped with Ctrl-C: a Ctrl-C right after ends the chat."""
    try:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    except ImportError:  # a Python built without it: plain input()
        pass
    while True:
        try:
            line = input(PROMPT)
        except EOFError:  # Ctrl-D
            write("\n")
            return
        except KeyboardInterrupt:
            write("\n")
            if state["stopped"]:
                return
            state["stopped"] = True
            note(HINT)
            continue
        if line.strip():
            yield line


def run(args: argparse.Namespace) -> int:
    """A conversation with a chat model: its chat template, replies streamed as they come."""
    check_sampling_flags(args)
    for i, message in enumerate(args.message, 1):
        if not message.strip():
            where = f" (message {i} of {len(args.message)})" if len(args.message) > 1 else ""
            raise ValueError(f"--message is empty{where}; nothing to answer")
    threads.configure(args.threads)
    model, tokenizer = load(args.model, "decoder", "qkv chat", args.weights)
    if not tokenizer.chat_template:
        raise ValueError(f"{args.model!r} has no chat template; use `qkv generate`")
    interactive = not args.message and sys.stdin.isatty()
    state = {"stopped": False}
    messages = [{"role": "system", "content": args.system}] if args.system else []
    for turn in terminal_turns(state) if interactive else piped_turns(args):
        state["stopped"] = False
        messages.append({"role": "user", "content": turn})
        shown: list[str] = []
        start = time.perf_counter()
        try:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            write("model> ")
            reply = _generate(model, tokenizer, ids, args, functools.partial(show, shown))
            text, cut = tokenizer.decode(reply), len(reply) == args.max_new_tokens
        except KeyboardInterrupt:
            if not interactive:
                raise
            state["stopped"] = True
            text, cut = "".join(shown), False
            reply = tokenizer.encode(text, add_special_tokens=False)
            write("\n")
            note(f"[stopped] {HINT}")
        else:
            write("\n")
        seconds = time.perf_counter() - start
        if cut:
            note(f"[cut off at --max-new-tokens {args.max_new_tokens}; raise it for longer "
                 "replies]")
        if args.stats:
            note(f"[{len(reply)} tokens in {seconds:.1f}s, {len(reply) / seconds:.1f} tokens/s]")
        messages.append({"role": "assistant", "content": text.strip()})
    return 0
