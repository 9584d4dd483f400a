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
import statistics
import sys
import time

import torch

from ..allocations import map_large_allocations
from ..data.atomic import write_json_atomic
from ..distributed import context_parallel
from ..models.pretrained import built_on_meta, fill, is_dtensor, materialize
from ..nn.blocks import checkpoint_blocks
from . import checkpoint, distributed, sharding
from .interrupt import Interrupted, StopOnSignal
from .loop_parts import (
    Stream,
    autocast,
    make_optimizer,
    peak_memory_bytes,
    reset_peak_memory,
    rng_state,
    set_rng_state,
)
from .plan import Plan, n_parameters, plan_line
from .progress import MetricsLog, Progress
from .result import RunResult
from .schedule import learning_rate


class DivergedError(ValueError):
    """The loss or the gradient stopped being finite; the weights were not updated with it."""


class Trainer:
    """Builds and trains the model of a ``plan`` (``qkv.train.plan.make``); only rank 0
    writes files or prints.

    Building a Trainer writes the run's files (``commit``) once the whole start (the model,
    the checkpoint it continues from) has succeeded; a start that fails leaves the run
    directory as it was. A fresh run learns its tokenizers anew; a resumed one reads the run's.
    """

    def __init__(self, plan: Plan, quiet: bool = False):
        self.plan = plan
        self.task, self.cfg, self.run_dir = plan.task, plan.cfg, plan.run_dir
        self.env, self.data = plan.env, plan.data
        self.verbose = self.env.is_main and not quiet
        t, env, found = self.cfg.train, self.env, plan.found
        if t.fsdp:  # memory is what sharding is for
            map_large_allocations()
        # From scratch, the whole model is drawn as one process draws it.
        build = functools.partial(self.task.build_model, self.cfg, self.data)
        self.model = built_on_meta(build) if plan.on_meta else build()
        if plan.init and not plan.on_meta:
            self.task.initialize(self.model, plan.init)
        if not plan.on_meta:
            self.model.to(env.device)
        if t.checkpointing:
            checkpoint_blocks(self.model)
        self.mesh = distributed.mesh(env, t.context_parallel)
        carried = None
        if t.fsdp:  # before the optimizer, which then holds each rank's shards
            if found is not None and not found.sharded:  # a DDP run continued sharded
                carried = found.load_unsharded(self.model, make_optimizer(self.model, t))
            sharding.shard(self.model, env, t)
        if plan.on_meta:  # filled here from train.init, or by resume() from the checkpoint
            materialize(self.model, env.device)
            if plan.init:
                self.task.initialize(self.model, plan.init)
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
        self.commit()

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
            if self.plan.afresh:
                print(f"qkv: {str(self.run_dir)!r} held a run stopped before its first "
                      "checkpoint; started it afresh", file=sys.stderr)
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

    def run(self) -> RunResult:
        """Train to ``train.steps``, evaluating and checkpointing on the way; then the final
        evaluation, and the result."""
        t, env = self.cfg.train, self.env
        model = self.wrapped_model()
        model.train()
        d_model = self.model.config.block.d_model
        if self.verbose and self.task.name == "lm":
            print(plan_line(self.cfg, self.model, self.plan.tokens_per_step, self.plan.sizing,
                            self.step, self.plan.block_note), file=sys.stderr, flush=True)
        progress = Progress(t.steps, self.data.unit, t.log_every, self.verbose, self.step)
        reset_peak_memory(env.device)  # the peak is training's, not the loading's before it
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
        return self.result(self.evaluate(final=True))

    def result(self, evaluation: dict | None) -> RunResult:
        """The run's result; under train.fsdp this gathers the whole model (``whole_model``)."""
        peak = peak_memory_bytes(self.env.device)  # training's, before a whole copy is made
        records = self.metrics.records() if self.env.is_main else []
        rates = [r["rate"] for r in records if r.get("rate") is not None]
        return RunResult(
            run_dir=self.run_dir, config=self.cfg, evaluation=evaluation, steps=self.step,
            seconds=self.earlier_seconds + self.seconds, first_step=self.first_step,
            session_seconds=self.seconds, unit=self.data.unit,
            throughput=statistics.median(rates) if rates else None,
            peak_memory_bytes=peak, parameters=n_parameters(self.model),
            is_main=self.env.is_main, model=self.whole_model(), data=self.data,
            losses=[(r["step"], r["loss"]) for r in records if "loss" in r])

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
