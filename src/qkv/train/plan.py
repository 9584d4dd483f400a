"""What a run will do, decided and said before its first step.

``make`` is a run's plan: every check that can refuse it (the run directory, the ranks, the
checkpoint to resume, the memory), its data, and the sizes a fine-tune takes from that data.
It builds no model and writes nothing, so a refused run leaves its directory as it was.

A real checkpoint trains slowly on a CPU (SmolLM2-135M: about 125 tokens/s on 2 cores), so a
fine-tune is sized to finish: one pass over the training text, capped at a compute budget
(parameters x tokens), with a warm-up that is a fraction of the steps. The plan line then
gives the parameters, tokens per step, the estimated time and peak memory, so a user knows
what to expect before waiting for it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import threads
from . import checkpoint, distributed, sharding
from .config import ConfigError, RunConfig
from .progress import format_seconds
from .rundir import RunError, unfinished_run
from .schedule import warmup_steps

# parameters x tokens: 5e12 is 37k tokens of SmolLM2-135M, about 6 minutes on the 2-core
# development machine (measured: 9.6 s per 1,024-token step); a larger checkpoint gets fewer.
FINE_TUNE_BUDGET = 5e12
FINE_TUNE_MIN_STEPS = 10
# Bytes per fp32 parameter in training: the weight, its gradient and AdamW's two moments.
TRAIN_BYTES_PER_PARAM = 16
# What the process holds besides the model: torch, the loaded checkpoint's file, buffers.
BASE_BYTES = 0.6e9
# Training runs at about this fraction of the probe matmul's FLOP rate (measured: 0.88).
MATMUL_EFFICIENCY = 0.8


@dataclass
class Plan:
    """A run checked and sized, ready for its Trainer (``qkv.train.loop``) to build."""

    task: Any
    cfg: RunConfig  # with the sizes taken from the data (cfg.auto is then empty)
    run_dir: Path
    env: distributed.Env
    data: Any  # the task's prepared data
    found: checkpoint.Checkpoint | None  # the checkpoint a resumed run continues from
    # Sharded, a model whose weights a checkpoint gives is built on the meta device, sharded,
    # then each rank's shard filled: no rank holds the whole model.
    on_meta: bool
    parameters: int
    sizing: str  # how train.steps was chosen
    block_note: str  # how a fine-tune's model.block_size was chosen ("" when set)
    afresh: bool  # it replaces a run killed before its first checkpoint

    @property
    def init(self) -> str:
        """The pretrained checkpoint the weights start from ("" from scratch or resumed)."""
        return self.cfg.train.init if self.found is None else ""

    @property
    def tokens_per_step(self) -> int:
        return tokens_per_step(self.cfg, self.data)


def tokens_per_step(cfg: RunConfig, data) -> int:
    """Training tokens (lm) per optimizer step: every micro-batch of every rank."""
    return cfg.train.batch_size * cfg.train.accumulate * data.block


def make(task, cfg: RunConfig, run_dir: str | Path, resume: bool,
         env: distributed.Env | None = None) -> Plan:
    """The plan of ``task`` with ``cfg`` in ``run_dir``, fresh or (``resume``) from its
    newest intact checkpoint; ``env`` is the process's place among the ranks (default: as
    torchrun's environment says). The global seed is set here, before the data is read, so
    the data and the model the Trainer then builds are drawn as in every run of that seed."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--run-dir {str(run_dir)!r} is a file; expected a directory (a new one, "
                       "or a run's)")
    t = cfg.train
    env = env or distributed.setup(t.device)
    afresh = not resume and unfinished_run(run_dir, cfg.task)
    sharding.check(t, env, resume)
    distributed.check_context_parallel(env, t.context_parallel)
    # The checkpoint first: a run without one fails before any data is read.
    found = checkpoint.load_latest(run_dir) if resume else None
    if resume and found is None:
        raise checkpoint.CheckpointError(f"{str(run_dir)!r} holds no checkpoint to resume")
    torch.manual_seed(t.seed)
    random.seed(t.seed)
    data = task.prepare(cfg, run_dir if resume else None, env)
    if t.context_parallel > 1 and not hasattr(data, "shard"):
        raise ValueError("train.context_parallel applies to the lm task only")
    block_note = ""
    if "model.block_size" in cfg.auto:  # a fine-tune's block, sized to a short text
        cfg, block_note = task.fit_block(cfg, data)
    shards = env.world_size // t.context_parallel if t.fsdp else 1
    on_meta = t.fsdp and bool((t.init and not resume) or (found is not None and found.sharded))
    params = count_parameters(task, cfg, data)
    check_fits(params, env.device, shards, whole=not on_meta)
    threads.configure(t.threads)  # after the checks: a refused run prints one line
    sizing = "train.steps as set"
    if cfg.auto:
        cfg, sizing = fine_tune_sizes(cfg, data.train_tokens(), params,
                                      tokens_per_step(cfg, data))
    return Plan(task, cfg, run_dir, env, data, found, on_meta, params, sizing, block_note,
                afresh)


def n_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once)."""
    return sum(p.numel() for p in model.parameters())


def fine_tune_sizes(cfg: RunConfig, train_tokens: int, params: int, tokens_per_step: int
                    ) -> tuple[RunConfig, str]:
    """``cfg`` with its ``cfg.auto`` train keys sized from the data, and a note saying how."""
    one_pass = max(1, math.ceil(train_tokens / tokens_per_step))
    cap = max(FINE_TUNE_MIN_STEPS, int(FINE_TUNE_BUDGET / params / tokens_per_step))
    steps = max(FINE_TUNE_MIN_STEPS, min(one_pass, cap))
    sizes = {"steps": steps, "checkpoint_every": max(1, steps // 4)}
    sizes = {k: v for k, v in sizes.items() if f"train.{k}" in cfg.auto}
    train = dataclasses.replace(cfg.train, **sizes)
    if "train.steps" not in cfg.auto:
        note = "train.steps as set"
    elif one_pass > cap:
        note = (f"one pass over the {train_tokens:,} training tokens would be {one_pass} steps; "
                f"capped at {steps} (set train.steps={one_pass} for the whole pass)")
    elif one_pass < steps:
        note = f"{FINE_TUNE_MIN_STEPS} steps at least: {one_pass} step(s) is one pass"
    else:
        note = f"one pass over the {train_tokens:,} training tokens"
    return dataclasses.replace(cfg, train=train, auto=frozenset()), note


# The model config fields that count identical layers: each adds the same parameters.
LAYER_COUNTS = ("n_layer", "n_encoder_layers", "n_decoder_layers")


def count_parameters(task, cfg: RunConfig, data) -> int:
    """The parameters of the model ``task`` builds for ``cfg``, counted on the meta device
    (nothing is allocated). The model is built with one and with two of each kind of layer
    and the count extrapolated, so a model of a million layers takes no longer to count."""
    fields = {f.name: f.default for f in dataclasses.fields(task.schema.model_cls)}
    layers = {name: cfg.model.get(name, fields[name]) for name in LAYER_COUNTS if name in fields}

    def count(**counts) -> int:
        with torch.device("meta"):
            model = task.build_model(dataclasses.replace(cfg, model={**cfg.model, **counts}),
                                     data)
        return n_parameters(model)

    ones = dict.fromkeys(layers, 1)
    base = count(**ones)
    return base + sum((count(**{**ones, name: 2}) - base) * (n - 1)
                      for name, n in layers.items())


def available_memory(device: torch.device) -> float:
    """Bytes free for a new run: on a GPU its free memory, on Linux MemAvailable (what can
    be allocated without swapping), elsewhere the free physical pages."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def check_fits(params: int, device: torch.device, shards: int = 1, whole: bool = True) -> None:
    """Refuse a model whose weights, gradients and AdamW moments alone exceed the memory
    available, before it is built: building it would fail (or swap) with a traceback. With
    ``shards`` > 1 (train.fsdp) a rank holds 1/shards of them, after building the whole
    model's float32 weights once if ``whole`` (from scratch; a model a checkpoint fills is
    sharded before its weights take memory)."""
    once = whole and shards > 1
    need = TRAIN_BYTES_PER_PARAM * params / shards + (4 * params if once else 0)
    have = available_memory(device)
    if need > have:
        where = "on the GPU" if device.type == "cuda" else "on this machine"
        what = "float32 weights, gradients and AdamW's two moments"
        if once:
            what = (f"the whole float32 weights, then 1/{shards} of them, of their gradients "
                    "and of AdamW's two moments")
        elif shards > 1:
            what = (f"1/{shards} of the float32 weights, of their gradients and of AdamW's "
                    "two moments")
        raise ConfigError(
            f"the model does not fit in memory: {params:,} parameters need about "
            f"{need / 1e9:,.1f} GB to train ({what}), and {have / 1e9:,.1f} GB is available "
            f"{where}; make the model smaller (model.block.d_model, model.n_layer, ...)")


def matmul_flops_per_second(d_model: int, seconds: float = 0.3) -> float:
    """The FLOP rate of a (1024, d) x (d, 4d) matmul on this machine now, with the threads
    training will use. Constant operands: drawing random ones would move the training RNG."""
    a, b = torch.full((1024, d_model), 0.5), torch.full((d_model, 4 * d_model), 0.5)
    a @ b
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * 1024 * d_model * 4 * d_model * count / (time.perf_counter() - start)


def peak_memory(params: int, config, tokens: int, checkpointing: bool) -> float:
    """Estimated peak bytes of a training step over ``tokens`` tokens of a GPT ``config``:
    weights, gradients and AdamW moments; the logits (three copies: values, log-softmax,
    gradient); the blocks' activations (only their inputs when checkpointing)."""
    d, ff = config.block.d_model, config.block.ff_width
    per_block = tokens * (10 * d + 4 * ff) * 4  # one block's saved tensors, fp32
    blocks = config.n_layer * tokens * d * 4 + per_block if checkpointing \
        else config.n_layer * per_block
    logits = 3 * tokens * config.vocab_size * 4
    return BASE_BYTES + TRAIN_BYTES_PER_PARAM * params + logits + blocks


def plan_line(cfg: RunConfig, model: torch.nn.Module, tokens_per_step: int, note: str,
              first_step: int = 0, block_note: str = "") -> str:
    """``plan: 134.5M parameters | 1,024 tokens/step x 47 steps (...) | about 6m30s | peak
    about 3.7 GB``: the estimated time from the model's FLOPs and a measured matmul rate;
    ``block_note``, when given, says after the steps how the block was sized."""
    t = cfg.train
    params = n_parameters(model)
    flops = (8 if t.checkpointing else 6) * params * tokens_per_step  # forward 2, backward 4
    rate = matmul_flops_per_second(model.config.block.d_model) * MATMUL_EFFICIENCY
    seconds = flops * (t.steps - first_step) / rate
    micro = tokens_per_step // t.accumulate
    memory = peak_memory(params, model.config, micro, t.checkpointing)
    threads = torch.get_num_threads()
    count = f"{params / 1e6:.1f}M" if params >= 1e6 else f"{params:,}"
    warmup = warmup_steps(t)
    cut = f" (train.warmup={t.warmup}, cut to the run)" if warmup < t.warmup and \
        not t.warmup_fraction else ""
    block = f" | {block_note}" if block_note else ""
    return (f"plan: {count} parameters | {tokens_per_step:,} tokens/step x "
            f"{t.steps} steps ({note}){block} | warm-up {warmup} steps{cut} | "
            f"{threads} thread{'s' if threads > 1 else ''} | about {format_seconds(seconds)} | "
            f"peak about {memory / 1e9:.1f} GB"
            f"{' (activation checkpointing)' if t.checkpointing else ''}")

