"""Pieces every task shares: tokenizers kept in the run directory, model building, loading."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...data.atomic import write_json_atomic
from ...data.tokenizers import load_tokenizer, save_tokenizer, train_tokenizer
from .. import distributed
from ..config import ConfigError


def run_tokenizer(run_dir: Path, name: str, env, kind: str, texts, vocab_size: int):
    """The tokenizer ``RUN/name.json``: loaded when present, else trained by rank 0 and saved
    (other ranks wait and load it, so every rank uses byte-identical vocabularies)."""
    path = run_dir / f"{name}.json"
    if not path.exists() and env.is_main:
        save_tokenizer(train_tokenizer(kind, texts(), vocab_size), path)
    distributed.barrier(env)
    return load_tokenizer(path)


def build(model_cls, config_cls, derived: dict, configured: dict, run_dir: Path | None):
    """``model_cls(config_cls(**derived, **configured))``; the full model config is written to
    ``RUN/model.json`` when ``run_dir`` is given."""
    try:
        config = config_cls(**derived, **configured)
    except TypeError as e:  # a required model field the configuration does not set
        raise ConfigError(f"model: {e}") from None
    model = model_cls(config)
    if run_dir is not None:
        write_json_atomic(run_dir / "model.json", dataclasses.asdict(config))
    return model


def n_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
