"""Run configuration: dataclass sections, a TOML/JSON file, ``--set key=value`` overrides.

A run's configuration has four sections: ``data`` and ``eval`` (a dataclass per task),
``train`` (shared) and ``model`` (the fields of the task's model config dataclass, minus
the ones the data decides, such as vocabulary sizes; its ``block`` and ``positions``
sections nest: ``model.block.n_head``). Every key is checked when the configuration is
built: an unknown key names its close matches (``model.n_head``: ``model.block.n_head``, ...),
a value of the wrong type names the expected type, a value out of its field's
range or choices names them (``qkv.limits``), and the model config's own cross-field checks
run.
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
from ..limits import Limit, limit_of, limited
from ..models.configs import SECTIONS as MODEL_SECTIONS


class ConfigError(ValueError):
    """A configuration key or value the user gave cannot be used."""


SEEDS = "[0, 4294967295]"  # what numpy's and torch's generators all accept
# Counts of steps and examples: a billion steps is weeks at a millisecond each, so a larger
# count is a typo (and an ETA in the billions of minutes).
COUNT = "[1, 1e9]"
COUNT_OR_0 = "[0, 1e9]"


@dataclass
class TrainConfig:
    steps: int = limited(1000, COUNT)
    # The global batch: split across DDP ranks, summed over accumulation.
    batch_size: int = limited(64, COUNT)
    accumulate: int = limited(1, COUNT)  # micro-batches per optimizer step
    # Peak learning rate; for schedule="noam" a multiplier of the paper's rate.
    lr: float = limited(1e-3, "(0, inf)")
    # "cosine" (warmup + cosine) | "noam" (the paper's) | "constant"
    schedule: str = limited("cosine", choices=("cosine", "noam", "constant"))
    warmup: int = limited(100, COUNT_OR_0)
    # > 0: the warm-up is this fraction of train.steps instead of train.warmup steps.
    warmup_fraction: float = limited(0.0, "[0, 1)")
    min_lr_ratio: float = limited(0.1, "[0, 1]")  # cosine ends at lr * min_lr_ratio
    weight_decay: float = limited(0.01, "[0, inf)")
    beta1: float = limited(0.9, "[0, 1)")
    beta2: float = limited(0.98, "[0, 1)")
    label_smoothing: float = limited(0.0, "[0, 1]")
    clip_grad: float = limited(1.0, "[0, inf)")  # max global gradient norm; 0 turns clipping off
    precision: str = limited("fp32", choices=("fp32", "bf16"))  # bf16: autocast
    compile: bool = False  # torch.compile the model
    seed: int = limited(0, SEEDS)
    eval_every: int = limited(0, COUNT_OR_0)  # 0: evaluate only at the end
    checkpoint_every: int = limited(200, COUNT)
    keep_checkpoints: int = limited(2, COUNT)
    log_every: int = limited(20, COUNT)
    device: str = limited("auto", choices=("auto", "cpu", "cuda"))
    threads: int = limited(0, "[0, 4096]")  # torch CPU threads; 0: automatic (qkv.threads)
    # Recompute each block's activations in the backward pass instead of holding them.
    checkpointing: bool = False
    # lm only: split each sequence over this many ranks (ring attention); the processes form
    # a (P / context_parallel) x context_parallel mesh, data parallel across its rows.
    context_parallel: int = limited(1, COUNT)
    context_layout: str = limited("zigzag", choices=("zigzag", "contiguous"))
    # Under torchrun: shard parameters, gradients and optimizer state over the data-parallel
    # ranks (FSDP2's fully_shard) instead of replicating them (DDP); checkpoints are sharded.
    fsdp: bool = False
    # With train.fsdp: the dtype blocks compute in, and the one gradients are reduced in
    # (the sharded weights and the optimizer stay float32).
    param_dtype: str = limited("float32", choices=("float32", "bfloat16"))
    reduce_dtype: str = limited("float32", choices=("float32", "bfloat16"))
    # lm only: a pretrained checkpoint (smollm2, a GPT-2 / LLaMA directory, a .gguf file)
    # whose weights and tokenizer the run starts from; empty: train from scratch.
    init: str = ""


SECTIONS = ("data", "model", "train", "eval")


@dataclass
class RunConfig:
    task: str
    data: Any
    model: dict = field(default_factory=dict)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: Any = None
    # section.name keys to size from the data once it is read (a fine-tune's train.steps,
    # its model.block_size, ...); not stored: config.json holds the values they got.
    auto: frozenset = frozenset()

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
    """The keys of one task's configuration, their types and their limits.

    ``derived`` maps each model field the data decides to a stand-in value (or a function of
    the model section giving one), so that the model config's own checks can run when the
    configuration is built, before any data is read.
    """

    def __init__(self, data_cls, eval_cls, model_cls, derived: dict[str, Any]):
        self.classes = {"data": data_cls, "train": TrainConfig, "eval": eval_cls}
        self.model_cls = model_cls
        self.types: dict[str, Any] = {}
        self.limits: dict[str, Limit] = {}
        for section, cls in self.classes.items():
            self._add(section, cls)
        for f in dataclasses.fields(model_cls):
            if f.name in MODEL_SECTIONS:  # model.block.n_head, model.positions.kind
                self._add(f"model.{f.name}", MODEL_SECTIONS[f.name])
            elif f.name not in derived:
                self._add_field("model", f, typing.get_type_hints(model_cls)[f.name])
        self.derived = derived

    def _add(self, prefix: str, cls) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            self._add_field(prefix, f, hints[f.name])

    def _add_field(self, prefix: str, f: dataclasses.Field, hint) -> None:
        key = f"{prefix}.{f.name}"
        self.types[key] = hint
        if limit_of(f) is not None:
            self.limits[key] = limit_of(f)

    def check(self, key: str, value):
        if key.startswith("model.") and key[6:] in self.derived:
            raise ConfigError(f"{key} is set from the data and cannot be configured")
        if key not in self.types:
            raise unknown_key(key, sorted(self.types))
        value = coerce(value, self.types[key], key)
        problem = self.limits[key].problem(value) if key in self.limits else None
        if problem:
            raise ConfigError(f"{key}: {problem}")
        return value

    def check_model(self, model: dict) -> None:
        """Build the model config with stand-ins for the derived fields: a missing required
        field or a rule between fields (d_model divisible by n_head, ...) is reported now."""
        required = [f.name for f in dataclasses.fields(self.model_cls)
                    if f.default is dataclasses.MISSING and f.name not in self.derived
                    and f.default_factory is dataclasses.MISSING]
        for name in required:
            if name not in model:
                raise ConfigError(f"model.{name} is required (it has no default)")
        stand_ins = {name: value(model) if callable(value) else value
                     for name, value in self.derived.items()}
        try:
            self.model_cls(**stand_ins, **model)
        except ValueError as e:
            raise ConfigError(f"model: {e}") from None

    def build(self, task: str, values: dict[str, Any]) -> RunConfig:
        """A RunConfig from flat ``section.name`` values (the dataclass defaults fill the rest);
        the model section nests its ``block`` and ``positions`` keys."""
        sections = {s: {} for s in SECTIONS} | nest(
            {key: self.check(key, value) for key, value in values.items()})
        self.check_model(sections["model"])
        return RunConfig(
            task=task,
            data=self.classes["data"](**sections["data"]),
            model=sections["model"],
            train=TrainConfig(**sections["train"]),
            eval=self.classes["eval"](**sections["eval"]),
        )


def flatten(tree: dict, where: str) -> dict[str, Any]:
    """{"train": {"lr": 1}, "model": {"block": {"n_head": 4}}} -> {"train.lr": 1,
    "model.block.n_head": 4}; a top-level key outside the sections is an error."""
    flat = {}
    for section, body in tree.items():
        if section == "task":
            continue
        if section not in SECTIONS:
            raise unknown_key(section, list(SECTIONS))
        if not isinstance(body, dict):
            raise ConfigError(f"{where}: section {section!r} must be a table of key = value")
        flat.update(_dotted(body, section))
    return flat


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """{"model.block.n_head": 4} -> {"model": {"block": {"n_head": 4}}} (``flatten`` undone)."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *path, name = key.split(".")
        target = tree
        for part in path:
            target = target.setdefault(part, {})
        target[name] = value
    return tree


def _dotted(body: dict, prefix: str) -> dict[str, Any]:
    flat = {}
    for name, value in body.items():
        if isinstance(value, dict):
            flat.update(_dotted(value, f"{prefix}.{name}"))
        else:
            flat[f"{prefix}.{name}"] = value
    return flat


def read_config_file(path: str | Path) -> dict:
    """A TOML (.toml) or JSON (anything else) configuration file as a dict."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"--config {str(path)!r} is a directory; expected a TOML or JSON file")
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


def explicit_keys(file_tree: dict | None, overrides: list[str]) -> set[str]:
    """The section.name keys the user set (in the config file or with --set), not the
    preset's."""
    keys = set(flatten(file_tree, "config file")) if file_tree else set()
    return keys | set(parse_overrides(overrides))


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
