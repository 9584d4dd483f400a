"""Load what ``qkv viz`` needs from a run directory: the model with its newest weights and
the tokenizers, without preparing the training data (the page needs none of it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

# task -> (model class name, its config class name, the tokenizer files it keeps)
TASK_MODELS = {
    "lm": ("GPT", "GPTConfig", ("tokenizer",)),
    "translate": ("Transformer", "TransformerConfig", ("tokenizer_src", "tokenizer_tgt")),
    "vit": ("ViT", "ViTConfig", ()),
}


class RunDirError(ValueError):
    """A run directory that holds no usable model."""


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
        raise RunDirError(f"{str(path)!r} ({what}) cannot be read: {e}") from None


def _load_weights(run_dir: Path, model: nn.Module) -> None:
    from safetensors.torch import load_model

    from ..train import checkpoint

    flat = run_dir / "model.safetensors"
    if flat.is_file():
        load_model(model, str(flat))
        return
    found = checkpoint.load_latest(run_dir)
    if found is None:
        raise RunDirError(
            f"{str(run_dir)!r} holds no model: no model.safetensors and no checkpoint under "
            f"checkpoints/ (train one first, e.g. `qkv train lm --run-dir {run_dir}`)"
        )
    found.load_weights(model)


def load_run(run_dir) -> LoadedRun:
    """The run's model (eval mode, newest weights), its tokenizers and its configuration."""
    from .. import models
    from ..data.tokenizers import load_tokenizer
    from ..train.run import read_run_config

    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"run directory {str(path)!r} does not exist")
    if not (path / "config.json").is_file():
        raise RunDirError(f"{str(path)!r} is not a qkv run directory (no config.json)")
    cfg = read_run_config(path)
    if cfg.task not in TASK_MODELS:
        raise RunDirError(f"`qkv viz` knows runs of {sorted(TASK_MODELS)}; {str(path)!r} is "
                          f"{cfg.task!r}")
    model_name, config_name, tokenizer_names = TASK_MODELS[cfg.task]
    model_json = path / "model.json"
    if not model_json.is_file():
        raise RunDirError(f"{str(path)!r} holds no model (no model.json with the model's config)")
    model_config = getattr(models, config_name)(**_read_json(model_json, "model config"))
    model = getattr(models, model_name)(model_config)
    _load_weights(path, model)
    tokenizers = {}
    for name in tokenizer_names:
        file = path / f"{name}.json"
        if not file.is_file():
            raise RunDirError(f"{str(path)!r} lacks its tokenizer {file.name}")
        tokenizers[name] = load_tokenizer(file)
    return LoadedRun(path, cfg.task, cfg, model.eval(), tokenizers)
