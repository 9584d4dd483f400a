"""Crash-safe checkpoints in a run directory.

``RUN/checkpoints/step-000200/`` holds ``model.safetensors`` (weights), ``trainer.pt``
(optimizer, schedule step, RNG states, data position) and ``manifest.json`` (the SHA-256 of
each file). A sharded checkpoint (``train.fsdp``) holds ``state/`` instead, where each rank
writes its shards of the weights and the optimizer state with ``torch.distributed.checkpoint``
(DCP), and ``trainer.pt`` has the rest; DCP reads it back at any number of ranks, or in one
process without a process group. A checkpoint is written into a temporary folder, each file
atomically, then the folder is renamed into place: a kill at any moment leaves the previous
checkpoint intact. On load the hashes are checked; a corrupt checkpoint is named and the
previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_model, save_model

from ..data.atomic import fsync_dir, write_atomic, write_json_atomic
from . import distributed

FILES = ("model.safetensors", "trainer.pt")
SHARDED_FILES = ("state/.metadata", "trainer.pt")


def _dcp():
    """torch.distributed.checkpoint and its state_dict helpers, imported by the sharded paths
    only: the import takes 1.3 s, which every command would pay at start-up
    (docs/performance.md, "Start-up")."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.state_dict as state_dict

    return dcp, state_dict


class CheckpointError(ValueError):
    """No usable checkpoint where one was asked for."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    trainer_state: dict

    @property
    def sharded(self) -> bool:
        return (self.path / "state").is_dir()

    def load_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """A sharded checkpoint's weights and optimizer state into ``model`` and ``optimizer``,
        sharded or not, at any number of ranks (collective when a process group exists)."""
        _, state_dict = _dcp()
        model_state, optimizer_state = state_dict.get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        self._read(state)
        state_dict.set_state_dict(model, optimizer, model_state_dict=state["model"],
                                  optim_state_dict=state["optimizer"])

    def load_unsharded(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """A single-file checkpoint's weights into the unsharded ``model`` and its optimizer
        state into ``optimizer``; returns that state keyed by parameter names, the form that
        ``set_optimizer_state_dict`` shards once the model is."""
        self.load_weights(model)
        optimizer.load_state_dict(self.trainer_state["optimizer"])
        return _dcp()[1].get_optimizer_state_dict(model, optimizer)

    def _read(self, state: dict) -> None:
        single = not (dist.is_available() and dist.is_initialized())
        try:
            with warnings.catch_warnings():  # one process reading it all is what is meant
                warnings.filterwarnings("ignore", "torch.distributed is disabled")
                _dcp()[0].load(state, checkpoint_id=self.path / "state", no_dist=single)
        except (RuntimeError, ValueError) as e:  # DCP names a missing key or a wrong shape
            detail = " ".join(str(e).split())[:300]
            raise CheckpointError(f"checkpoint {self.path} does not fit the model: {detail}"
                                  ) from None

    def load_weights(self, model: torch.nn.Module) -> None:
        """Copy the saved weights into ``model`` (tied weights are restored as tied)."""
        if self.sharded:  # into the model's own tensors: every key, every shape checked
            state = {"model": model.state_dict()}
            self._read(state)
            model.load_state_dict(state["model"])
            return
        device = next(model.parameters()).device
        try:
            load_model(model, self.path / "model.safetensors", strict=True, device=str(device))
        except RuntimeError as e:  # names or shapes that differ from the model's
            detail = " ".join(line.strip() for line in str(e).splitlines()[:2])
            raise CheckpointError(f"checkpoint {self.path} does not fit the model: {detail}"
                                  ) from None


def load_full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                              state: dict) -> None:
    """``load_unsharded``'s optimizer state, keyed by parameter names, into the optimizer of
    the model now sharded: each rank keeps its shard of it."""
    state_dict = _dcp()[1]
    state_dict.set_optimizer_state_dict(model, optimizer, state,
                                        options=state_dict.StateDictOptions(full_state_dict=True))


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def save(run_dir: str | Path, step: int, model: torch.nn.Module, trainer_state: dict,
         keep: int) -> Path:
    """Write checkpoint ``step`` and delete all but the newest ``keep`` (>= 1) ones."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint being written); got {keep}")

    root = checkpoint_root(run_dir)
    final = root / f"step-{step:06d}"
    temp = root / f".step-{step:06d}.partial-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    write_atomic(temp / "model.safetensors", lambda p: save_model(model, p))
    write_atomic(temp / "trainer.pt", lambda p: torch.save(trainer_state, p))
    return finish(temp, final, step, keep)


def finish(temp: Path, final: Path, step: int, keep: int) -> Path:
    """Hash every file written into ``temp``, move it to ``final``, prune to ``keep``."""
    names = sorted(p.relative_to(temp).as_posix() for p in temp.rglob("*") if p.is_file())
    manifest = {"step": step, "sha256": {name: sha256(temp / name) for name in names}}
    write_json_atomic(temp / "manifest.json", manifest)
    if final.exists():
        shutil.rmtree(final)
    os.replace(temp, final)
    fsync_dir(final.parent)
    for old in list_checkpoints(final.parent.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_sharded(run_dir: str | Path, step: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, trainer_state: dict, keep: int,
                 env: distributed.Env) -> Path:
    """Every rank writes its shards into rank 0's temporary folder (one folder every rank
    can reach: on several machines, a shared file system); rank 0 adds ``trainer_state``,
    the manifest, and renames the folder into place."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint being written); got {keep}")
    root = checkpoint_root(run_dir)
    final = root / f"step-{step:06d}"
    temp = distributed.broadcast_object(env, root / f".step-{step:06d}.partial-{os.getpid()}")
    if env.is_main:
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir(parents=True)
    distributed.barrier(env)
    dcp, state_dict = _dcp()
    model_state, optimizer_state = state_dict.get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temp / "state")
    if env.is_main:  # dcp.save returns once every rank's files and the metadata are written
        write_atomic(temp / "trainer.pt", lambda p: torch.save(trainer_state, p))
        finish(temp, final, step, keep)
    distributed.barrier(env)
    return final


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_partials(run_dir: str | Path) -> list[Path]:
    """Delete the temporary folders of saves whose process was killed before it could finish
    (a folder named after a live process other than this one is left alone); returns them."""
    root = checkpoint_root(run_dir)
    removed = []
    for temp in sorted(root.glob(".step-*.partial-*")) if root.is_dir() else []:
        pid = temp.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and process_alive(int(pid)):
            continue
        shutil.rmtree(temp, ignore_errors=True)
        removed.append(temp)
    return removed


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Finished checkpoint folders, newest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    return sorted((p for p in root.glob("step-*") if p.is_dir()), reverse=True)


def problem_with(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, or None when every hash matches."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        expected = manifest["sha256"]
    except (OSError, ValueError, KeyError):
        return "manifest.json is missing or unreadable"
    for name in SHARDED_FILES if (path / "state").is_dir() else FILES:
        if name not in expected:
            return f"manifest.json does not list {name}"
    for name in expected:
        if not (path / name).is_file():
            return f"{name} is missing"
        if sha256(path / name) != expected.get(name):
            return f"{name} does not match its SHA-256 in manifest.json"
    return None


def load_latest(run_dir: str | Path) -> Checkpoint | None:
    """The newest intact checkpoint; corrupt ones are named on stderr and skipped.

    Returns None when the run has no checkpoint at all; raises CheckpointError when every
    checkpoint is corrupt.
    """
    found = list_checkpoints(run_dir)
    problems = []
    for path in found:
        problem = problem_with(path)
        if problem is None:
            trainer_state = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
            if problems:
                print(f"qkv: using checkpoint {path}", file=sys.stderr)
            return Checkpoint(path, int(path.name.split("-")[1]), trainer_state)
        problems.append(f"{path}: {problem}")
        print(f"qkv: checkpoint {path} is corrupt ({problem})", file=sys.stderr)
    if problems:
        raise CheckpointError("no intact checkpoint: " + "; ".join(problems))
    return None
