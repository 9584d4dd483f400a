"""Run directories: start or resume a training run, and load a finished run for inference.

A run directory holds everything needed to reproduce or use the run: ``config.json`` (the
full configuration, usable as ``--config``), ``model.json`` (the model's config),
the tokenizers (``tokenizer*.json``), ``metrics.jsonl`` and ``checkpoints/``.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..data.atomic import write_json_atomic
from . import checkpoint, distributed
from .config import ConfigError, RunConfig, flatten, parse_overrides, resolve
from .loop import Trainer
from .tasks import TASKS


class RunError(ValueError):
    """A run directory that cannot be used for what was asked."""


def get_task(name: str):
    if name not in TASKS:
        raise ConfigError(f"unknown task {name!r}; expected one of {', '.join(TASKS)}")
    return TASKS[name]


def read_run_config(run_dir: str | Path, expected_task: str | None = None,
                    overrides: list[str] = ()) -> RunConfig:
    """The RunConfig stored in ``RUN/config.json`` with ``--set`` style ``overrides``, checked
    against the task's schema."""
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise RunError(f"{str(run_dir)!r} is not a qkv run directory (no config.json)")
    try:
        tree = json.loads(path.read_text())
        task_name = tree["task"]
    except (ValueError, KeyError):
        raise RunError(f"{str(path)!r} is not a readable qkv run configuration") from None
    if expected_task is not None and task_name != expected_task:
        raise RunError(f"{str(run_dir)!r} holds a {task_name!r} run, not {expected_task!r}")
    stored = flatten(tree, str(path))
    return resolve(get_task(task_name).schema, task_name, stored, None, list(overrides))


def resume_config(run_dir: str | Path, task: str, overrides: list[str]) -> RunConfig:
    """The configuration to continue ``run_dir`` with: the stored one plus ``overrides``.
    A change to a model or data key is refused: the checkpoints hold that model, trained on
    that data (and the tokenizers were learned from it)."""
    stored = read_run_config(run_dir, task)
    cfg = read_run_config(run_dir, task, overrides)
    before, after = stored.to_dict(), cfg.to_dict()
    for section in ("model", "data"):
        for key in sorted(set(before[section]) | set(after[section])):
            if before[section].get(key) != after[section].get(key):
                raise ConfigError(
                    f"--resume cannot change {section}.{key} (the run was trained with "
                    f"{before[section].get(key)!r}); start a new --run-dir instead")
    return cfg


def start(cfg: RunConfig, run_dir: str | Path, resume: bool, quiet: bool = False) -> Trainer:
    """A Trainer for ``cfg`` in ``run_dir``: fresh (the folder must hold no run yet) or
    resumed from the newest intact checkpoint."""
    run_dir = Path(run_dir)
    env = distributed.setup(cfg.train.device)
    if not resume and checkpoint.list_checkpoints(run_dir):
        raise RunError(
            f"{str(run_dir)!r} already holds a run; add --resume or pick a new --run-dir")
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_dir / "config.json", cfg.to_dict())
    distributed.barrier(env)
    trainer = Trainer(get_task(cfg.task), cfg, run_dir, env, quiet)
    if resume:
        trainer.resume()
    return trainer


def load(run_dir: str | Path, device: str = "cpu", task: str | None = None,
         overrides: list[str] = ()):
    """(task, cfg, data, model) of a run, the model holding its newest intact checkpoint.

    ``task`` (when given) is the task the caller needs; ``overrides`` (``eval.KEY=VALUE``
    items) change how the run is evaluated or used, never what it is.
    """
    for key in parse_overrides(list(overrides)):
        if not key.startswith("eval."):
            raise ConfigError(f"a trained run takes only eval.* overrides; got {key!r}")
    cfg = read_run_config(run_dir, task, overrides)
    task = get_task(cfg.task)
    env = distributed.Env(0, 1, distributed.pick_device(device, 0))
    data = task.prepare(cfg, Path(run_dir), env, train=False)
    model = task.build_model(cfg, data)
    found = checkpoint.load_latest(run_dir)
    if found is None:
        raise RunError(f"{str(run_dir)!r} holds no checkpoint yet")
    model.to(env.device).eval()
    found.load_weights(model)
    return task, cfg, data, model
