"""Pieces every task shares: tokenizers kept in the run directory, model building."""

from __future__ import annotations

from pathlib import Path

from ...data.tokenizers import read_tokenizer, tokenizer_from_json, train_tokenizer
from .. import distributed


def run_tokenizer(run_dir: Path | None, name: str, env, kind: str, texts, vocab_size: int,
                  new_files: dict[str, dict]):
    """The tokenizer ``RUN/name.json`` of an existing run (a missing file is named). For a new
    run (``run_dir`` None), one learned by rank 0 and sent to the other ranks, so that every
    rank uses a byte-identical vocabulary; it is added to ``new_files`` (file name -> JSON)
    for the start to write once everything else has succeeded."""
    if run_dir is not None:
        return read_tokenizer(run_dir / f"{name}.json")
    tree = train_tokenizer(kind, texts(), vocab_size).to_json() if env.is_main else None
    tree = distributed.broadcast_object(env, tree)
    new_files[f"{name}.json"] = tree
    return tokenizer_from_json(tree)


def build(model_cls, config_cls, derived: dict, configured: dict):
    """``model_cls(config_cls(**derived, **configured))`` (the configuration has checked that
    every required field is set)."""
    return model_cls(config_cls(**derived, **configured))

