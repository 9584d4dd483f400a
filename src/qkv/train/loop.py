"""The training loop shared by every task.

Determinism: the batch at micro-step g is a pure function of (seed, g) (a seeded
permutation per epoch), and a checkpoint stores the step, the micro-step, the optimizer and
every RNG state, so a resumed run takes exactly the steps an uninterrupted one would.

Distributed: every rank draws the same global batch and takes its own contiguous slice;
each rank's summed loss is divided by the global weight (tokens or images of the whole
step) and multiplied by the world size, so DDP's gradient average equals the gradient of the
one-process run with the same global batch.

Context parallelism (``train.context_parallel`` = C): the slice is per row of the
(data, context) mesh, and each of the row's C ranks takes its shard of every sequence and
runs the model inside ``qkv.distributed.context_parallel``. DDP still averages over every
rank: each rank's loss covers its own tokens, so the same scaling holds, and the attention
leaves the gradients of the tensors it reads to DDP (``sum_extra_grads=False``).

FSDP (``train.fsdp``, ``sharding``): the model is sharded in place before the optimizer is
made, in place of DDP; its gradient reduction averages over every rank as DDP's does, so the
same scaling holds, and its checkpoints are sharded (``checkpoint.save_sharded``). A model
a checkpoint fills (``train.init``, a sharded checkpoint resumed) is built on the meta device
and sharded before it takes memory (``qkv.models.pretrained.materialize``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import sys
import time
from pathlib import Path

import torch

from .. import threads
from ..allocations import map_large_allocations
from ..data.atomic import write_json_atomic
from ..distributed import context_parallel
from ..models.pretrained import built_on_meta, fill, is_dtensor, materialize
from ..nn.blocks import checkpoint_blocks
from . import checkpoint, distributed, plan, sharding
from .config import RunConfig
from .interrupt import Interrupted, StopOnSignal
from .loop_parts import (
    Stream,
    autocast,
    make_optimizer,
    peak_memory_bytes,
    rng_state,
    set_rng_state,
)
from .progress import MetricsLog, Progress
from .schedule import learning_rate


class DivergedError(ValueError):
    """The loss or the gradient stopped being finite; the weights were not updated with it."""


class Trainer:
    """Runs ``task`` with ``cfg`` in ``run_dir``; only rank 0 writes files or prints.

    Building a Trainer writes nothing: ``commit`` writes the run's files once the whole start
    (data, tokenizers, model, the checkpoint to resume from) has succeeded. A fresh Trainer
    learns its tokenizers anew; a resumed one (``resume=True``) reads the run's.
    """

    def __init__(self, task, cfg: RunConfig, run_dir: str | Path, env: distributed.Env,
                 quiet: bool = False, resume: bool = False):
        self.task, self.cfg, self.run_dir, self.env = task, cfg, Path(run_dir), env
        self.verbose = env.is_main and not quiet
        t = cfg.train
        sharding.check(t, env, resume)
        distributed.check_context_parallel(env, t.context_parallel)
        # The checkpoint first: a run without one fails before any data is read.
        found = checkpoint.load_latest(self.run_dir) if resume else None
        if resume and found is None:
            raise checkpoint.CheckpointError(f"{str(self.run_dir)!r} holds no checkpoint to resume")
        torch.manual_seed(t.seed)
        random.seed(t.seed)
        self.data = task.prepare(cfg, self.run_dir if resume else None, env)
        self.block_note = ""
        if "model.block_size" in cfg.auto:  # a fine-tune's block, sized to a short text
            cfg, self.block_note = task.fit_block(cfg, self.data)
            self.cfg, t = cfg, cfg.train
        shards = env.world_size // t.context_parallel if t.fsdp else 1
        init = t.init if not resume else ""
        # Sharded, a model whose weights a checkpoint gives takes memory only once it is:
        # built on the meta device, sharded, then each rank's shard filled (no rank holds
        # the whole model). From scratch, the whole model is drawn as one process draws it.
        on_meta = t.fsdp and bool(init or (found is not None and found.sharded))
        plan.check_fits(plan.count_parameters(task, cfg, self.data), env.device, shards,
                        whole=not on_meta)
        threads.configure(t.threads)  # after the checks: a refused run prints one line
        if t.fsdp:  # memory is what sharding is for
            map_large_allocations()
        build = functools.partial(task.build_model, cfg, self.data)
        self.model = built_on_meta(build) if on_meta else build()
        if init and not on_meta:
            task.initialize(self.model, init)
        if not on_meta:
            self.model.to(env.device)
        self.sizing = "train.steps as set"
        if cfg.auto:
            cfg, self.sizing = plan.fine_tune_sizes(
                cfg, self.data.train_tokens(), plan.n_parameters(self.model),
                self.tokens_per_step())
            self.cfg, t = cfg, cfg.train
        if t.checkpointing:
            checkpoint_blocks(self.model)
        if t.context_parallel > 1 and not hasattr(self.data, "shard"):
            raise ValueError("train.context_parallel applies to the lm task only")
        self.mesh = distributed.mesh(env, t.context_parallel)
        carried = None
        if t.fsdp:  # before the optimizer, which then holds each rank's shards
            if found is not None and not found.sharded:  # a DDP run continued sharded
                carried = found.load_unsharded(self.model, make_optimizer(self.model, t))
            sharding.shard(self.model, env, t)
        if on_meta:  # filled here from train.init, or by resume() from the checkpoint
            materialize(self.model, env.device)
            if init:
                task.initialize(self.model, init)
        self.optimizer = make_optimizer(self.model, t)
        if carried is not None:
            checkpoint.load_full_optimizer_state(self.model, self.optimizer, carried)
        self.stream = Stream(self.data.train_size, t.batch_size, t.seed)
        self.step = 0
        self.micro_step = 0  # the data position: micro-batches drawn from the stream so far
        self.first_step = 0  # where this session started (> 0 when resumed)
        # Training time of the earlier sessions, up to the checkpoint this one resumed from.
        self.earlier_seconds = 0.0
        self.started = self.seconds = 0.0
        self.metrics = MetricsLog(self.run_dir, env.is_main)
        # Each rank gets its own dropout stream; rank 0 keeps the plain seed.
        torch.manual_seed(t.seed + env.rank)
        if found is not None:
            self.resume(found)

    def tokens_per_step(self) -> int:
        """Training tokens (lm) per optimizer step: every micro-batch of every rank."""
        t = self.cfg.train
        return t.batch_size * t.accumulate * self.data.block

    def resume(self, found: checkpoint.Checkpoint) -> None:
        state = found.trainer_state
        if found.sharded:  # DCP reshards: any number of ranks, with or without train.fsdp
            found.load_state(self.model, self.optimizer)
        elif not self.cfg.train.fsdp:  # (with it, loaded before the model was sharded)
            found.load_weights(self.model)
            self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.micro_step = state["step"], state["micro_step"]
        self.first_step, self.earlier_seconds = self.step, state.get("seconds", 0.0)
        rngs = state["rng"]
        set_rng_state(rngs[self.env.rank] if self.env.rank < len(rngs) else rngs[0])

    def commit(self) -> None:
        """Write the run's files: config.json, model.json and new tokenizers; cut
        metrics.jsonl back to the checkpoint resumed from (or empty it for a fresh start); remove
        the partial checkpoint folders that killed runs left."""
        if self.env.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for path in checkpoint.remove_partials(self.run_dir):
                print(f"qkv: removed {path}, a checkpoint a killed run left unfinished",
                      file=sys.stderr)
            files = {"config.json": self.cfg.to_dict(),
                     "model.json": dataclasses.asdict(self.model.config), **self.data.new_files}
            for name, tree in files.items():
                write_json_atomic(self.run_dir / name, tree)
            self.metrics.truncate_after(self.step)
        distributed.barrier(self.env)

    def save(self) -> None:
        rngs = distributed.gather_objects(self.env, rng_state())
        state = {"step": self.step, "micro_step": self.micro_step, "rng": rngs,
                 "seconds": self.earlier_seconds + time.perf_counter() - self.started}
        keep = self.cfg.train.keep_checkpoints
        if self.cfg.train.fsdp:
            checkpoint.save_sharded(self.run_dir, self.step, self.model, self.optimizer, state,
                                    keep, self.env)
        elif self.env.is_main:
            state["optimizer"] = self.optimizer.state_dict()
            checkpoint.save(self.run_dir, self.step, self.model, state, keep)
        distributed.barrier(self.env)

    def evaluate(self, final: bool) -> dict | None:
        result = None
        # A sharded model's forward gathers each unit's weights from every rank: all ranks
        # evaluate (the same data, the same result) and rank 0 writes.
        if self.env.is_main or self.cfg.train.fsdp:
            self.model.eval()
            with torch.no_grad(), autocast(self.cfg.train, self.env.device):
                result = self.task.evaluate(self.model, self.data, self.cfg, final=final)
            self.model.train()
        if self.env.is_main:
            self.metrics.write({"step": self.step, "eval": result})
        distributed.barrier(self.env)
        return result

    def whole_model(self) -> torch.nn.Module | None:
        """The trained model with all its weights on rank 0 (None on the other ranks): the
        model itself, or under train.fsdp an unsharded copy, built on the meta device and
        filled one parameter at a time as each is gathered (collective: every rank gathers
        it, then drops it), so rank 0 holds the whole weights once. Under train.fsdp this
        ends the training: the optimizer's state is dropped first."""
        if not self.cfg.train.fsdp:
            return self.model if self.env.is_main else None
        # Training is over and its last checkpoint holds the optimizer's state: rank 0's
        # whole copy takes that memory instead of coming on top of it.
        self.optimizer.state.clear()
        self.model.reshard()  # evaluation may leave the root unit's weights gathered
        whole = None
        if self.env.is_main:
            build = functools.partial(self.task.build_model, self.cfg, self.data)
            whole = materialize(built_on_meta(build), self.env.device)
        into = dict(whole.named_parameters()) if whole is not None else {}
        for name, param in self.model.named_parameters():
            full = param.full_tensor()
            if whole is not None:
                fill(into[name], full)
        return whole.eval() if whole is not None else None

    def wrapped_model(self) -> torch.nn.Module:
        model = self.model
        if self.cfg.train.fsdp:  # sharded in place; its blocks compiled one by one
            return model
        if self.env.distributed:
            ids = [self.env.device.index] if self.env.device.type == "cuda" else None
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if self.cfg.train.compile:
            model = torch.compile(model)
        return model

    def train_step(self, model: torch.nn.Module) -> tuple[float, int]:
        """The gradients of one optimizer step over ``accumulate`` micro-batches; returns
        (loss, local units). The weights are not touched (``run`` updates them)."""
        t, env = self.cfg.train, self.env
        batches = [self.stream.indices(self.micro_step + m) for m in range(t.accumulate)]
        self.micro_step += t.accumulate
        weight = sum(self.data.weight(ix) for ix in batches)
        total = torch.zeros((), device=env.device)
        units = 0
        mesh = self.mesh
        split = contextlib.nullcontext()
        if mesh.context_group is not None:
            split = context_parallel(mesh.context_group, t.context_layout, sum_extra_grads=False)
        for m, ix in enumerate(batches):
            local = self.data.batch(ix.tensor_split(mesh.data_size)[mesh.data_rank], env.device)
            if mesh.context_group is not None:
                local = self.data.shard(local, env.rank % t.context_parallel,
                                        t.context_parallel, t.context_layout)
            last = m == len(batches) - 1
            sync = contextlib.nullcontext()
            if t.fsdp:  # reduce-scatter the gradients once, after the last micro-batch
                model.set_requires_gradient_sync(last)
            elif not last and env.distributed:
                sync = model.no_sync()
            with sync:
                with autocast(t, env.device), split:
                    loss_sum = self.task.loss_sum(model, local, t)
                (loss_sum.float() * env.world_size / weight).backward()
            total += loss_sum.detach().float()
            units += self.data.units(local)
        loss = distributed.all_sum(env, total).item() / weight
        # Always measured (an infinite limit clips nothing), so a non-finite gradient stops
        # the run before it reaches the weights and, from there, a checkpoint.
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.clip_grad or math.inf)
        if is_dtensor(norm):  # the norm of sharded gradients, summed over the ranks
            norm = norm.full_tensor()
        norm = float(norm)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.stop_diverged(loss, norm)
        return loss, units

    def stop_diverged(self, loss: float, norm: float) -> None:
        what = f"the loss is {loss}" if not math.isfinite(loss) else f"the gradient norm is {norm}"
        saved = checkpoint.list_checkpoints(self.run_dir)
        kept = f"its newest checkpoint is {saved[0].name}" if saved else "it has no checkpoint"
        raise DivergedError(
            f"training stopped at step {self.step + 1}: {what}; the weights were not updated "
            f"and {kept} (try a lower train.lr or train.clip_grad > 0)")

    def run(self) -> dict | None:
        """Train to ``train.steps``, evaluating and checkpointing on the way; the final eval."""
        t, env = self.cfg.train, self.env
        model = self.wrapped_model()
        model.train()
        d_model = self.model.config.block.d_model
        if self.verbose and self.task.name == "lm":
            print(plan.plan_line(self.cfg, self.model, self.tokens_per_step(), self.sizing,
                                 self.step, self.block_note), file=sys.stderr, flush=True)
        progress = Progress(t.steps, self.data.unit, t.log_every, self.verbose, self.step)
        self.started = time.perf_counter()
        # Where an interrupted step rolls back to: its data position, its RNG.
        at_start = (self.step, self.micro_step, rng_state())
        with StopOnSignal(enabled=not env.distributed) as stop:
            try:
                while self.step < t.steps:
                    at_start = (self.step, self.micro_step, rng_state())
                    lr = learning_rate(t, self.step, d_model)
                    for group in self.optimizer.param_groups:
                        group["lr"] = lr
                    loss, units = self.train_step(model)
                    # A signal here waits: the update, the step count and its record agree.
                    with stop.critical():
                        self.optimizer.step()
                        self.optimizer.zero_grad(set_to_none=True)
                        self.step += 1
                        rate = progress.update(self.step, loss, lr, units * env.world_size)
                        self.metrics.write({"step": self.step, "loss": loss, "lr": lr,
                                            "rate": rate})
                    if t.eval_every and self.step % t.eval_every == 0 and self.step < t.steps:
                        result = self.evaluate(final=False)
                        if self.verbose:
                            progress.message(f"step {self.step}: {self.task.summary(result)}")
                    if self.step % t.checkpoint_every == 0 or self.step == t.steps:
                        self.save()
            except KeyboardInterrupt:
                if not stop.enabled:
                    raise
                progress.message("")
                self.save_interrupted(at_start, stop.exit_code)
        self.seconds = time.perf_counter() - self.started
        return self.evaluate(final=True)

    def save_interrupted(self, at_start: tuple[int, int, dict], exit_code: int) -> None:
        """Save the last finished step (rolling back one that was under way) and raise
        Interrupted saying how to resume."""
        step, micro_step, rngs = at_start
        self.model.train()  # an evaluation may have been cut short
        self.optimizer.zero_grad(set_to_none=True)
        if self.step == step:  # the step under way never reached the weights
            self.micro_step = micro_step
            set_rng_state(rngs)
        if self.step == 0:
            raise Interrupted("interrupted before the first step finished; nothing to save",
                              exit_code)
        path = checkpoint.checkpoint_root(self.run_dir) / f"step-{self.step:06d}"
        if checkpoint.problem_with(path) is not None:
            self.save()
        raise Interrupted(
            f"interrupted at step {self.step}/{self.cfg.train.steps}; checkpoint {path}; "
            f"continue with: qkv train {self.cfg.task} --run-dir {self.run_dir} --resume",
            exit_code)

    def time_report(self) -> str:
        """The training time over every session, and this session's share when resumed."""
        line = f"trained {self.step} steps in {self.earlier_seconds + self.seconds:.1f}s"
        if 0 < self.first_step < self.step:
            line += (f" in all (this session: steps {self.first_step + 1}-{self.step} in "
                     f"{self.seconds:.1f}s)")
        return line + f"; peak memory {peak_memory_bytes(self.env.device) / 1e9:.2f} GB"
