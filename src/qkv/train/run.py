"""Run directories: start or resume a training run, and load a finished run for inference.

The files of a run directory, and reading them, are ``rundir``'s.

A start that fails (bad data, a model the config cannot build, no intact checkpoint to
resume) leaves the directory exactly as it was: nothing is written before it has succeeded.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import checkpoint, distributed
from .config import ConfigError, RunConfig, flatten, parse_overrides
from .loop import Trainer
from .rundir import RunError, get_task, read_run_config


def adopt_checkpoint(task, cfg: RunConfig, explicit: set[str]) -> RunConfig:
    """``cfg`` with the model section of its ``train.init`` checkpoint (and the attention
    options the user set that add no parameters); refused for tasks that cannot start from
    one."""
    adopt = getattr(task, "adopt_checkpoint", None)
    if adopt is None:
        raise ConfigError(f"train.init (--init) starts lm runs from a pretrained checkpoint; "
                          f"the {cfg.task!r} task cannot")
    return adopt(cfg, explicit)


def resume_config(run_dir: str | Path, task: str, overrides: list[str]) -> RunConfig:
    """The configuration to continue ``run_dir`` with: the stored one plus ``overrides``.
    A change to a model or data key is refused: the checkpoints hold that model, trained on
    that data (and the tokenizers were learned from it)."""
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


RUN_FILES = ("config.json", "model.json", "metrics.jsonl", "tokenizer.json",
             "tokenizer_src.json", "tokenizer_tgt.json")


def unfinished_run(run_dir: Path, task: str) -> bool:
    """Whether a fresh ``task`` start in ``run_dir`` replaces a run of that task killed before
    its first checkpoint (True) or starts in a folder that holds no run (False). A folder that
    holds a run with checkpoints or of another task, or files of a run's names that are not a
    qkv run's, is refused."""
    if checkpoint.list_checkpoints(run_dir):
        raise RunError(
            f"{str(run_dir)!r} already holds a run; add --resume or pick a new --run-dir")
    present = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not present:
        return False
    try:
        stored = read_run_config(run_dir)
    except ValueError:
        raise RunError(f"{str(run_dir)!r} holds {', '.join(present)} but no readable qkv run; "
                       "pick a new --run-dir") from None
    if stored.task != task:
        raise RunError(f"{str(run_dir)!r} holds a {stored.task!r} run stopped before its first "
                       f"checkpoint; pick a new --run-dir for a {task!r} run")
    return True


def start(cfg: RunConfig, run_dir: str | Path, resume: bool, quiet: bool = False) -> Trainer:
    """A Trainer for ``cfg`` in ``run_dir``: fresh or resumed from the newest intact
    checkpoint. A fresh start over a run killed before its first checkpoint starts that run
    afresh (its metrics, tokenizers and configuration are replaced) and says so."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise RunError(f"--run-dir {str(run_dir)!r} is a file; expected a directory (a new one, "
                       "or a run's)")
    env = distributed.setup(cfg.train.device)
    afresh = not resume and unfinished_run(run_dir, cfg.task)
    trainer = Trainer(get_task(cfg.task), cfg, run_dir, env, quiet, resume=resume)
    trainer.commit()
    if afresh and env.is_main:
        print(f"qkv: {str(run_dir)!r} held a run stopped before its first checkpoint; "
              "started it afresh", file=sys.stderr)
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
