"""Run configuration: dataclass sections, a TOML/JSON file, ``--set key=value`` overrides.

A run's configuration has four sections: ``data`` and ``eval`` (a dataclass per task),
``train`` (shared) and ``model`` (the fields of the task's model config dataclass, minus
the ones the data decides, such as vocabulary sizes). Every key is checked: an unknown key
names its close matches, a value of the wrong type names the expected type.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from ..data.errors import DataError


class ConfigError(ValueError):
    """A configuration key or value the user gave cannot be used."""


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 64  # the global batch: split across DDP ranks, summed over accumulation
    accumulate: int = 1  # micro-batches per optimizer step
    lr: float = 1e-3  # peak learning rate; for schedule="noam" a multiplier of the paper's rate
    schedule: str = "cosine"  # "cosine" (warmup + cosine) | "noam" (the paper's) | "constant"
    warmup: int = 100
    min_lr_ratio: float = 0.1  # cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.98
    label_smoothing: float = 0.0
    clip_grad: float = 1.0  # max global gradient norm; 0 turns clipping off
    precision: str = "fp32"  # "fp32" | "bf16" (autocast)
    compile: bool = False  # torch.compile the model
    seed: int = 0
    eval_every: int = 0  # 0: evaluate only at the end
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    log_every: int = 20
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    threads: int = 0  # torch CPU threads; 0 keeps torch's default


SECTIONS = ("data", "model", "train", "eval")


@dataclass
class RunConfig:
    task: str
    data: Any
    model: dict = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: Any = None

    def to_dict(self) -> dict:
        return {
            "task": self.task,
            "data": dataclasses.asdict(self.data),
            "model": dict(self.model),
            "train": dataclasses.asdict(self.train),
            "eval": dataclasses.asdict(self.eval),
        }


def describe(annotation) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def coerce(value, annotation, key: str):
    """``value`` as ``annotation`` (int, float, bool, str, list/tuple of those, X | None)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(value, option, key)
            except ConfigError:
                pass
    elif origin in (list, tuple):
        (inner, *_) = typing.get_args(annotation) or (Any,)
        if isinstance(value, (list, tuple)):
            return origin(coerce(v, inner, key) for v in value)
    elif annotation is Any:
        return value
    elif annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    elif annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif annotation in (bool, str) and isinstance(value, annotation):
        return value
    raise ConfigError(f"{key}: expected {describe(annotation)}, got {value!r}")


def parse_value(text: str):
    """A ``--set`` value: a TOML/JSON literal (1, 0.5, true, [1, 2], "x"), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def unknown_key(key: str, known: list[str]) -> ConfigError:
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(known)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


class Schema:
    """The keys of one task's configuration and their types."""

    def __init__(self, data_cls, eval_cls, model_cls, derived: set[str]):
        self.classes = {"data": data_cls, "train": TrainConfig, "eval": eval_cls}
        self.model_cls = model_cls
        self.types: dict[str, Any] = {}
        for section, cls in self.classes.items():
            for name, hint in typing.get_type_hints(cls).items():
                self.types[f"{section}.{name}"] = hint
        for name, hint in typing.get_type_hints(model_cls).items():
            if name not in derived:
                self.types[f"model.{name}"] = hint
        self.derived = {f"model.{name}" for name in derived}

    def check(self, key: str, value):
        if key in self.derived:
            raise ConfigError(f"{key} is set from the data and cannot be configured")
        if key not in self.types:
            raise unknown_key(key, sorted(self.types))
        return coerce(value, self.types[key], key)

    def build(self, task: str, values: dict[str, Any]) -> RunConfig:
        """A RunConfig from flat ``section.name`` values (the dataclass defaults fill the rest)."""
        sections: dict[str, dict] = {s: {} for s in SECTIONS}
        for key, value in values.items():
            section, name = key.split(".", 1)
            sections[section][name] = self.check(key, value)
        return RunConfig(
            task=task,
            data=self.classes["data"](**sections["data"]),
            model=sections["model"],
            train=TrainConfig(**sections["train"]),
            eval=self.classes["eval"](**sections["eval"]),
        )


def flatten(tree: dict, where: str) -> dict[str, Any]:
    """{"train": {"lr": 1}} -> {"train.lr": 1}; a top-level key outside the sections is an error."""
    flat = {}
    for section, body in tree.items():
        if section == "task":
            continue
        if section not in SECTIONS:
            raise unknown_key(section, list(SECTIONS))
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section {section!r} must be a table of key = value")
        for name, value in body.items():
            flat[f"{section}.{name}"] = value
    return flat


def read_config_file(path: str | Path) -> dict:
    """A TOML (.toml) or JSON (anything else) configuration file as a dict."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    try:
        tree = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid: {e}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a table/object of sections")
    return tree


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """["train.lr=3e-4", ...] -> {"train.lr": 0.0003, ...}."""
    flat = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        flat[key.strip()] = parse_value(text.strip())
    return flat


def resolve(
    schema: Schema, task: str, preset: dict[str, Any], file_tree: dict | None, overrides: list[str]
) -> RunConfig:
    """Defaults < preset < config file < ``--set`` overrides, all checked against the schema."""
    if file_tree is not None and file_tree.get("task", task) != task:
        raise ConfigError(f"the config file is for task {file_tree['task']!r}, not {task!r}")
    values = dict(preset)
    if file_tree is not None:
        values.update(flatten(file_tree, "config file"))
    values.update(parse_overrides(overrides))
    return schema.build(task, values)
