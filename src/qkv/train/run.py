"""A training run as one call, ``train(RunRequest(...))``: config, plan, trainer, result.

``qkv train`` and every ``qkv lab`` run go this one way:

- ``configure``: the request's configuration (defaults < preset < config file < ``--set``;
  a resumed run's stored one; a fine-tune's taken from its checkpoint), checked key by key;
- ``plan.make``: every check that can refuse the run, its data, and what the data sizes;
- ``Trainer``: the model, its optimizer and the checkpoint it continues from; the run's files;
- ``Trainer.run``: the steps, then a ``RunResult``.

A start that fails (bad data, a model the config cannot build, no intact checkpoint to
resume) leaves the run directory exactly as it was: nothing is written before it succeeded.
``load`` reads a finished run back for inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import checkpoint, distributed, plan
from .config import (
    ConfigError,
    RunConfig,
    explicit_keys,
    flatten,
    parse_overrides,
    read_config_file,
    resolve,
)
from .loop import Trainer
from .result import RunResult
from .rundir import RunError, get_task, read_run_config


@dataclass(frozen=True)
class RunRequest:
    """What a user asks for: ``qkv train TASK --preset P --config FILE --set K=V ...
    --run-dir DIR [--resume]``. A resumed run keeps its stored configuration: ``overrides``
    may change how it trains, never its model or data."""

    task: str
    run_dir: Path | None = None  # needed to train (and to resume); not to configure
    preset: str = "default"
    config_file: str | Path | None = None
    overrides: tuple[str, ...] = ()
    resume: bool = False
    quiet: bool = False  # no progress output


def train(request: RunRequest) -> RunResult:
    """Run ``request`` to its ``train.steps``: configure, plan, build, train."""
    cfg = configure(request)
    if request.run_dir is None:
        raise ConfigError("a run needs a run directory (--run-dir)")
    trainer = Trainer(plan.make(get_task(cfg.task), cfg, request.run_dir, request.resume),
                      quiet=request.quiet)
    return trainer.run()


def configure(request: RunRequest) -> RunConfig:
    """The checked configuration of ``request``."""
    task = get_task(request.task)
    overrides = list(request.overrides)
    if request.resume:
        if request.run_dir is None:
            raise ConfigError("--resume needs --run-dir (the run to continue)")
        if "train.init" in parse_overrides(overrides):
            raise ConfigError("--init starts a new run; --resume continues one "
                              "(drop --init, or train.init)")
        if request.config_file is not None:
            raise ConfigError("--config starts a new run; --resume continues one with its "
                              "stored configuration (change how it trains with --set)")
        return _resumed(request.run_dir, request.task, overrides)
    if request.preset not in task.presets:
        raise ConfigError(f"unknown preset {request.preset!r}; expected one of "
                          f"{', '.join(task.presets)}")
    tree = read_config_file(request.config_file) if request.config_file is not None else None
    cfg = resolve(task.schema, request.task, task.presets[request.preset], tree, overrides)
    if not cfg.train.init:
        return cfg
    adopt = getattr(task, "adopt_checkpoint", None)
    if adopt is None:
        raise ConfigError(f"train.init (--init) starts lm runs from a pretrained checkpoint; "
                          f"the {cfg.task!r} task cannot")
    # The checkpoint's model section, with the attention options the user set that add no
    # parameters.
    return adopt(cfg, explicit_keys(tree, overrides))


def _resumed(run_dir: str | Path, task: str, overrides: list[str]) -> RunConfig:
    """The stored configuration of ``run_dir`` plus ``overrides``. A change to a model or data
    key is refused: the checkpoints hold that model, trained on that data (and the tokenizers
    were learned from it)."""
    stored = read_run_config(run_dir, task)
    cfg = read_run_config(run_dir, task, overrides)
    fixed = lambda c: flatten({s: c.to_dict()[s] for s in ("model", "data")}, "")  # noqa: E731
    before, after = fixed(stored), fixed(cfg)
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key):
            raise ConfigError(
                f"--resume cannot change {key} (the run was trained with "
                f"{before.get(key)!r}); start a new --run-dir instead")
    return cfg


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
