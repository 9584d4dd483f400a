"""lm: the decoder-only GPT on text.

Embedded default: the docstrings of the Python standard library (``qkv.data.docstrings``);
the last ``data.test_fraction`` of the text is held out. User data: ``data.path`` names any
UTF-8 text file.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from ...data.docstrings import stdlib_docstrings
from ...data.text import read_text_file, split_text
from ...distributed import shard
from ...models import GPT, GPTConfig, load_tokenizer
from ...models.pretrained import load_gpt_config, load_gpt_weights
from ...models.pretrained.usage import TextStream
from ...models.scoring import summed_cross_entropy, token_nll
from ..config import ConfigError, RunConfig, Schema, flatten, limited, nest
from .common import build, run_tokenizer


@dataclass
class LMData:
    path: str = ""  # a UTF-8 text file; empty: the standard library's docstrings
    max_chars: int = limited(1_500_000, "[1, inf)")  # embedded corpus size
    test_fraction: float = limited(0.1, "(0, 1)")  # the held-out tail of the text
    tokenizer: str = limited("char", choices=("char", "bpe"))
    vocab_size: int = limited(1000, "[5, inf)")  # bpe only; the 4 special tokens and more


@dataclass
class LMEval:
    max_tokens: int = limited(100_000, "[0, inf)")  # held-out tokens scored (0: all)
    batch_size: int = limited(64, "[1, inf)")
    max_new_tokens: int = limited(200, "[1, inf)")  # `qkv generate`
    temperature: float = limited(0.8, "[0, inf)")  # 0: greedy
    top_k: int = limited(0, "[0, inf)")  # 0: no top-k filtering
    top_p: float = limited(1.0, "(0, 1]")
    beam_size: int = limited(1, "[1, inf)")  # > 1: beam search instead of sampling


PRESETS = {
    # nanoGPT's small CPU configuration (shakespeare_char on a laptop): 4 layers, 4 heads,
    # d_model 128, context 64, batch 12, 2000 steps, lr 1e-3 decaying to 1e-4.
    "default": {
        "model.n_layer": 4, "model.block_size": 64, "model.block.n_head": 4,
        "model.block.d_model": 128, "model.block.dropout": 0.0,
        "train.steps": 2000, "train.batch_size": 12, "train.lr": 1e-3, "train.warmup": 100,
        "train.beta2": 0.99, "train.eval_every": 500, "train.checkpoint_every": 500,
        "train.log_every": 50, "train.threads": 1,
    },
    "tiny": {
        "data.max_chars": 20_000, "eval.max_tokens": 1000, "eval.max_new_tokens": 20,
        "model.n_layer": 1, "model.block_size": 16, "model.block.n_head": 2,
        "model.block.d_model": 32,
        "train.steps": 6, "train.batch_size": 8, "train.warmup": 2,
        "train.checkpoint_every": 3, "train.log_every": 2,
    },
}


class TextData:
    """Token ids of the training and held-out text; a training example is a window start."""

    unit = "tok"

    def __init__(self, tokenizer, train_text: str, test_text: str, block_size: int,
                 new_files: dict[str, dict]):
        self.tokenizer, self.new_files = tokenizer, new_files
        self.train_ids = torch.tensor(tokenizer.encode(train_text), dtype=torch.long)
        self.test_ids = torch.tensor(tokenizer.encode(test_text), dtype=torch.long)
        self.chars_per_token = len(test_text) / max(1, len(self.test_ids))
        self.set_block(block_size)

    def set_block(self, block_size: int) -> None:
        """Windows of ``block_size`` tokens: the training starts and the offsets of a window."""
        self.block = block_size
        self.train_size = max(0, len(self.train_ids) - block_size - 1)
        self.offsets = torch.arange(block_size + 1)

    def weight(self, index: torch.Tensor) -> int:
        return len(index) * self.block

    def batch(self, index: torch.Tensor, device) -> dict:
        windows = self.train_ids[index[:, None] + self.offsets]  # (B, block + 1)
        return {"x": windows[:, :-1].to(device), "y": windows[:, 1:].to(device)}

    def units(self, batch: dict) -> int:
        return batch["y"].numel()

    def train_tokens(self) -> int:
        return len(self.train_ids)

    def shard(self, batch: dict, rank: int, world: int, layout: str) -> dict:
        """This rank's part of every sequence in ``batch`` (context parallelism)."""
        return {name: shard(t, rank, world, layout, dim=1) for name, t in batch.items()}


def corpus(data: LMData) -> tuple[str, str]:
    text = read_text_file(data.path) if data.path else stdlib_docstrings(data.max_chars)
    return split_text(text, data.test_fraction)


# What a run may change on a pretrained checkpoint: options that add no parameters.
# block_size is the training window (at most the checkpoint's context).
CHANGEABLE_ON_CHECKPOINT = ("window", "block.dropout", "block.similarity", "block_size")
DEFAULT_INIT_BLOCK = 256
# A fine-tune's train settings unless the user sets them: a pretrained model forgets at the
# from-scratch preset's 1e-3; every core (its matrices are large enough to share); a line per
# step (a step takes seconds); activations recomputed (SmolLM2: 3.7 GB peak instead of 9);
# the held-out score on a few windows at a time (the logits of a 49k vocabulary are large).
FINE_TUNE_TRAIN = {
    "lr": 1e-4, "threads": 0, "log_every": 1, "eval_every": 0, "warmup_fraction": 0.1,
    "checkpointing": True,
}
FINE_TUNE_EVAL = {"max_tokens": 4096, "batch_size": 4}
# A fine-tune's step: about 1k tokens, enough to average out a noisy gradient.
FINE_TUNE_TOKENS_PER_STEP = 1024
# Sized from the data once it is read (qkv.train.plan.fine_tune_sizes).
FINE_TUNE_AUTO = ("train.steps", "train.checkpoint_every")
# A fine-tune's block, when the user sets none, shrinks to a text too short for
# DEFAULT_INIT_BLOCK (a power of two, so 1,024 tokens still make whole steps), down to this:
# shorter windows than a few sentences teach a model little about its context.
MIN_FITTED_BLOCK = 32


def more_text(data: LMData, part: str) -> str:
    """The data settings that give ``part`` ("training" or "held-out") more tokens."""
    longer = f"a longer text in data.path (now {data.path!r})" if data.path else \
        f"a larger data.max_chars (now {data.max_chars:,})"
    fraction = "larger" if part == "held-out" else "smaller"
    return f"{longer} or a {fraction} data.test_fraction (now {data.test_fraction})"


def longest_block(part: str, tokens: int) -> int:
    """The longest block ``tokens`` of ``part`` hold: a window takes block_size + 1 tokens,
    and training draws from more than one start."""
    return tokens - 1 if part == "held-out" else tokens - 2


def too_long(block: int, part: str, tokens: int, data: LMData) -> ConfigError:
    return ConfigError(
        f"model.block_size={block} is too long for the text: its {part} part has {tokens:,} "
        f"tokens, and a window takes block_size + 1 (set model.block_size to at most "
        f"{longest_block(part, tokens):,}, or give {more_text(data, part)})")


def check_windows(data: TextData, cfg) -> None:
    """Refuse a text that holds no training window or no held-out window of ``data.block``."""
    if data.train_size < 1:
        raise too_long(data.block, "training", len(data.train_ids), cfg.data)
    scored_ids(data, cfg)


def scored_ids(data: TextData, cfg) -> torch.Tensor:
    """The held-out ids the evaluation scores: whole windows of ``data.block`` tokens (and
    the next token), within eval.max_tokens."""
    ids, limit = data.test_ids, cfg.eval.max_tokens
    if len(ids) <= data.block:
        raise too_long(data.block, "held-out", len(ids), cfg.data)
    if limit and limit < data.block:
        raise ConfigError(f"eval.max_tokens={limit} is less than one window of "
                          f"model.block_size={data.block} tokens; nothing would be scored")
    if limit:
        ids = ids[: limit + 1]
    return ids[: (len(ids) - 1) // data.block * data.block + 1]


class LMTask:
    name = "lm"
    presets = PRESETS

    def adopt_checkpoint(self, cfg, explicit: set[str]):
        """``cfg`` whose model section is the ``train.init`` checkpoint's, with the
        changeable options the user set (``explicit``: section.name keys); any other model key
        is refused. The train and eval settings the user did not set get a fine-tune's
        (``FINE_TUNE_TRAIN``, ``FINE_TUNE_EVAL``; the steps once the data is read)."""
        explicit_model = {key[6:] for key in explicit if key.startswith("model.")}
        fixed = sorted(explicit_model - set(CHANGEABLE_ON_CHECKPOINT))
        if fixed:
            raise ConfigError(
                f"model.{fixed[0]} cannot change on a pretrained checkpoint (--init); a run "
                f"may set model.{', model.'.join(CHANGEABLE_ON_CHECKPOINT)}")
        base = dataclasses.asdict(load_gpt_config(cfg.train.init))
        chosen = flatten({"model": cfg.model}, "config")
        model = flatten({"model": base}, "checkpoint config")
        del model["model.vocab_size"]
        model["model.block_size"] = min(base["block_size"], DEFAULT_INIT_BLOCK)
        model.update({f"model.{key}": chosen[f"model.{key}"] for key in explicit_model})
        model = nest(model)["model"]
        if model["block_size"] > base["block_size"]:
            raise ConfigError(f"model.block_size={model['block_size']} exceeds the checkpoint's "
                              f"context of {base['block_size']} tokens")
        if model["block"]["similarity"] == "mahalanobis":
            raise ConfigError("model.block.similarity='mahalanobis' adds parameters a "
                              "pretrained checkpoint does not have")
        block = model["block_size"]
        train = {k: v for k, v in FINE_TUNE_TRAIN.items() if f"train.{k}" not in explicit}
        if "train.batch_size" not in explicit:
            train["batch_size"] = max(1, FINE_TUNE_TOKENS_PER_STEP // block)
        evals = {k: v for k, v in FINE_TUNE_EVAL.items() if f"eval.{k}" not in explicit}
        auto = frozenset(k for k in (*FINE_TUNE_AUTO, "model.block_size", "train.batch_size")
                         if k not in explicit)
        return dataclasses.replace(cfg, model=model, auto=auto,
                                   train=dataclasses.replace(cfg.train, **train),
                                   eval=dataclasses.replace(cfg.eval, **evals))

    def fit_block(self, cfg: RunConfig, data: TextData) -> tuple[RunConfig, str]:
        """(cfg, note) for a fine-tune whose block the user did not set: the default block, or
        for a text too short for it the longest power of two that leaves a training and a
        held-out window (with the batch size that keeps a step's tokens, unless set), and the
        note the plan prints; ``data`` takes that block. A text without windows of
        MIN_FITTED_BLOCK tokens is refused, naming model.block_size and the data settings."""
        auto = cfg.auto - {"model.block_size", "train.batch_size"}
        block = data.block
        room, part, tokens = min((longest_block(name, len(ids)), name, len(ids)) for name, ids
                                 in (("training", data.train_ids), ("held-out", data.test_ids)))
        if room >= block:
            check_windows(data, cfg)
            return dataclasses.replace(cfg, auto=auto), ""
        if room < MIN_FITTED_BLOCK:
            raise ConfigError(
                f"the text is too short to fine-tune on: its {part} part has {tokens:,} tokens, "
                f"too few for model.block_size={MIN_FITTED_BLOCK}, the shortest it is sized to "
                f"when unset; give {more_text(cfg.data, part)}, or set model.block_size to at "
                f"most {room:,}")
        fitted = 2 ** int(math.log2(room))
        data.set_block(fitted)
        check_windows(data, cfg)
        train = cfg.train
        if "train.batch_size" in cfg.auto:
            train = dataclasses.replace(train, batch_size=max(
                1, FINE_TUNE_TOKENS_PER_STEP // fitted))
        note = (f"model.block_size={fitted}, not {block}: the text's {part} part has "
                f"{tokens:,} tokens (set model.block_size to choose)")
        return dataclasses.replace(cfg, model={**cfg.model, "block_size": fitted}, train=train,
                                   auto=auto), note

    def initialize(self, model, init: str) -> None:
        """Copy the weights of checkpoint ``init`` into ``model`` (built from its config; whole,
        or sharded by FSDP, when each rank takes its part), one tensor at a time."""
        vocab = load_gpt_config(init).vocab_size
        if vocab != model.config.vocab_size:
            raise ConfigError(f"{init}: the model's vocabulary ({vocab}) and its tokenizer's "
                              f"({model.config.vocab_size}) differ; qkv cannot start from it")
        load_gpt_weights(model, init)

    @property
    def schema(self) -> Schema:
        return Schema(LMData, LMEval, GPTConfig, {"vocab_size": 256})

    def prepare(self, cfg, run_dir: Path | None, env, train: bool = True) -> TextData:
        train_text, test_text = corpus(cfg.data)
        new_files = {}
        if cfg.train.init and run_dir is None:  # a new run keeps its checkpoint's tokenizer

            tok = load_tokenizer(cfg.train.init)
            new_files["tokenizer.json"] = tok.to_json()
        else:
            tok = run_tokenizer(run_dir, "tokenizer", env, cfg.data.tokenizer,
                                lambda: [train_text], cfg.data.vocab_size, new_files)
        data = TextData(tok, train_text if train else "", test_text, cfg.model["block_size"],
                        new_files)
        # Before the model is built and trained, not at the final evaluation; a block sized
        # to the text is checked once it is (fit_block).
        if train and "model.block_size" not in cfg.auto:
            check_windows(data, cfg)
        return data

    def build_model(self, cfg, data: TextData):
        return build(GPT, GPTConfig, {"vocab_size": data.tokenizer.vocab_size}, cfg.model)

    def loss_sum(self, model, batch: dict, train_cfg) -> torch.Tensor:
        return summed_cross_entropy(model, batch["x"], batch["y"], train_cfg.label_smoothing)

    def evaluate(self, model, data: TextData, cfg, final: bool) -> dict:
        """Held-out loss (nats/token), perplexity and bits per character over non-overlapping
        windows; for BPE, characters per token is the held-out text's average."""
        device = next(model.parameters()).device
        ids = scored_ids(data, cfg).to(device)
        total, tokens = token_nll(model, ids, data.block, cfg.eval.batch_size)
        loss = total / tokens
        return {
            "loss": loss, "perplexity": math.exp(min(loss, 50.0)),
            "bits_per_char": loss / math.log(2) / data.chars_per_token, "tokens": tokens,
        }

    def summary(self, result: dict) -> str:
        return (f"held-out loss {result['loss']:.4f} | perplexity {result['perplexity']:.2f} | "
                f"bits/char {result['bits_per_char']:.3f} ({result['tokens']} tokens)")

    def generate(self, model, data: TextData, cfg, prompt: str,
                 max_new_tokens: int | None = None, seed: int = 0, write=None) -> str:
        """Continue ``prompt`` by ``max_new_tokens`` (default eval.max_new_tokens) tokens, with
        the run's eval sampling settings; past the context length, the model sees the most
        recent half of its context window while it writes the next half. ``write(text)``
        receives the text as it is sampled (with beam search: once, at the end)."""
        e = cfg.eval
        max_new_tokens = e.max_new_tokens if max_new_tokens is None else max_new_tokens
        ids = data.tokenizer.encode(prompt)[-data.block :] or [data.tokenizer.unk_id]
        start = len(ids)
        device = next(model.parameters()).device
        generator = torch.Generator(device=device).manual_seed(seed)
        stream = TextStream(data.tokenizer, write) if write and e.beam_size == 1 else None
        while len(ids) - start < max_new_tokens:
            context = ids[-(data.block // 2) :] if len(ids) > data.block // 2 else ids
            n_new = min(max_new_tokens - (len(ids) - start), data.block - len(context))
            out = model.generate(
                torch.tensor([context], device=device), max_new_tokens=n_new,
                temperature=e.temperature, top_k=e.top_k or None, top_p=e.top_p,
                beam_size=e.beam_size, generator=generator, on_token=stream,
            )
            ids += out[0, len(context) :].tolist()
        text = data.tokenizer.decode(ids[start:])
        if write and stream is None:
            write(text)
        return text

    def report(self, model, data: TextData, cfg, run_dir: Path, out, heatmap=None) -> None:
        sample = self.generate(model, data, cfg, "Return the", 120)
        print(f"sample: Return the{sample}", file=out)
