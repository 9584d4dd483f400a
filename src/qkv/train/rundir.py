"""Run directories: what ``train`` writes and both ``train`` and ``viz`` read.

A run directory holds everything needed to reproduce or use the run: ``config.json`` (the
full configuration, usable as ``--config``), ``model.json`` (the model's config), the
tokenizers (``tokenizer*.json``), ``metrics.jsonl`` and ``checkpoints/``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from safetensors.torch import load_model
from torch import nn

from .. import models
from ..data.tokenizers import read_tokenizer
from . import checkpoint
from .config import ConfigError, RunConfig, flatten, resolve
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


# task -> (model class, its config class, the tokenizer files it keeps)
TASK_MODELS = {
    "lm": (models.GPT, models.GPTConfig, ("tokenizer",)),
    "translate": (models.Transformer, models.TransformerConfig,
                  ("tokenizer_src", "tokenizer_tgt")),
    "vit": (models.ViT, models.ViTConfig, ()),
}


@dataclass
class LoadedRun:
    path: Path
    task: str
    config: object  # the run's RunConfig (data / eval / train sections)
    model: nn.Module
    tokenizers: dict = field(default_factory=dict)


def _read_json(path: Path, what: str) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise RunError(f"{str(path)!r} ({what}) cannot be read: {e}") from None


def load_weights(run_dir: Path, model: nn.Module) -> None:
    """The run's newest intact checkpoint (or a plain ``model.safetensors``) into ``model``."""
    flat = run_dir / "model.safetensors"
    if flat.is_file():
        load_model(model, str(flat))
        return
    found = checkpoint.load_latest(run_dir)
    if found is None:
        raise RunError(
            f"{str(run_dir)!r} holds no model: no model.safetensors and no checkpoint under "
            f"checkpoints/ (train one first, e.g. `qkv train lm --run-dir {run_dir}`)"
        )
    found.load_weights(model)


def load_run(run_dir) -> LoadedRun:
    """The run's model (eval mode, newest weights), its tokenizers and its configuration,
    without preparing the training data (the viewer needs none of it)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunError(f"run directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise RunError(f"{str(path)!r} is not a qkv run directory (no config.json)")
    cfg = read_run_config(path)
    if cfg.task not in TASK_MODELS:
        raise RunError(f"`qkv viz` knows runs of {sorted(TASK_MODELS)}; {str(path)!r} is "
                          f"{cfg.task!r}")
    model_cls, config_cls, tokenizer_names = TASK_MODELS[cfg.task]
    model_json = path / "model.json"
    if not model_json.is_file():
        raise RunError(f"{str(path)!r} holds no model (no model.json with the model's config)")
    stored = _read_json(model_json, "model config")
    model = model_cls(config_cls(**stored))
    load_weights(path, model)
    tokenizers = {}
    for name in tokenizer_names:
        file = path / f"{name}.json"
        if not file.is_file():
            raise RunError(f"{str(path)!r} lacks its tokenizer {file.name}")
        tokenizers[name] = read_tokenizer(file)
    return LoadedRun(path, cfg.task, cfg, model.eval(), tokenizers)
