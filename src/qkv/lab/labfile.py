"""The lab file: a task, a preset, seeds, shared ``--set`` overrides and named variants.

Everything is checked before any run starts, each variant's overrides through the same
config checks as ``qkv train --set``; a problem is one ``ConfigError`` naming its key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import tomllib

from ..train import config, run
from ..train.config import ConfigError, RunConfig
from ..train.rundir import get_task

LAB_KEYS = ("task", "preset", "seeds", "set")
VARIANT_KEYS = ("set",)
# The lab decides these per run: the seed from lab.seeds, the threads from the cores.
OWNED = {"train.seed": "lab.seeds", "train.threads": "--threads and --jobs",
         "train.init": "nothing (a lab trains from scratch)"}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...]  # the shared ones, then the variant's own


@dataclass(frozen=True)
class Lab:
    path: Path
    task: str
    preset: str
    seeds: tuple[int, ...]
    variants: tuple[Variant, ...]  # the first is the baseline

    def run_config(self, variant: Variant, seed: int, threads: int = 0) -> RunConfig:
        """The run's configuration, resolved as ``qkv train TASK --preset P --set ...``."""
        extra = (f"train.seed={seed}", f"train.threads={threads}")
        return run.configure(run.RunRequest(self.task, preset=self.preset,
                                            overrides=(*variant.overrides, *extra)))


def _unknown(where: str, keys, allowed: tuple[str, ...]) -> None:
    for key in keys:
        if key not in allowed:
            raise ConfigError(f"unknown key {where}{key} (expected {', '.join(allowed)})")


def _overrides(where: str, value) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: expected a list of \"section.key=value\" strings")
    try:
        keys = config.parse_overrides(list(value))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    for key in keys:
        if key in OWNED:
            raise ConfigError(f"{where}: {key} is set by {OWNED[key]}")
    return list(value)


def _seeds(value) -> tuple[int, ...]:
    if (not isinstance(value, list) or not value
            or not all(isinstance(s, int) and not isinstance(s, bool) for s in value)):
        raise ConfigError("lab.seeds: expected a non-empty list of whole numbers")
    if len(set(value)) != len(value):
        raise ConfigError(f"lab.seeds: a seed is listed twice ({value})")
    return tuple(value)


def parse(tree: dict, path: Path) -> Lab:
    """A checked Lab from the file's tables."""
    _unknown("", tree, ("lab", "variants"))
    lab = tree.get("lab")
    if not isinstance(lab, dict):
        raise ConfigError("lab: the file needs a [lab] table with task and seeds")
    _unknown("lab.", lab, LAB_KEYS)
    if "task" not in lab:
        raise ConfigError("lab.task is required (lm, translate or vit)")
    try:
        task = get_task(lab["task"])
    except ConfigError as e:
        raise ConfigError(f"lab.task: {e}") from None
    preset = lab.get("preset", "default")
    if preset not in task.presets:
        raise ConfigError(f"lab.preset: unknown preset {preset!r}; expected one of "
                          f"{', '.join(task.presets)}")
    seeds = _seeds(lab.get("seeds", [0]))
    shared = _overrides("lab.set", lab.get("set", []))
    variants = tree.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise ConfigError("variants: the file needs at least one [variants.NAME] table")
    found = []
    for name, body in variants.items():
        if not NAME.fullmatch(name):
            raise ConfigError(f"variants.{name}: a variant's name is letters, digits, "
                              "'_', '.' and '-' (it names the run directories)")
        if not isinstance(body, dict):
            raise ConfigError(f"variants.{name}: expected a table with set = [...]")
        _unknown(f"variants.{name}.", body, VARIANT_KEYS)
        own = _overrides(f"variants.{name}.set", body.get("set", []))
        found.append(Variant(name, tuple(shared + own)))
    result = Lab(path, lab["task"], preset, seeds, tuple(found))
    # Every value checked as qkv train --set checks it: the shared ones, then each variant's.
    for where, variant in [("lab.set", Variant("", tuple(shared))),
                           *((f"variants.{v.name}.set", v) for v in result.variants)]:
        try:
            result.run_config(variant, seeds[0])
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    return result


def read(path: str | Path) -> Lab:
    """The checked lab file at ``path``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"lab file {str(path)!r} not found (or not a file)")
    try:
        tree = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"lab file {str(path)!r} is not valid TOML: {e}") from None
    return parse(tree, path)
