"""Allowed values beside each dataclass field: ``limited(default, "[1, inf)")`` or
``limited(default, choices=...)``, checked by ``check_limits`` when a config is built.

The model configs (``nn``, ``models``) and the run configuration (``train``) all declare
their fields this way, so a field's range sits next to the field.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Limit:
    """The values a field accepts: an interval such as "[1, inf)" or "(0, 1]" (applied to
    each element of a list), and/or choices: a tuple, or a function giving one (for sets that
    grow at run time, such as registered similarities). Floats must also be finite."""

    interval: str | None = None
    choices: tuple | Callable[[], tuple] = ()

    def allowed(self) -> tuple:
        return self.choices() if callable(self.choices) else self.choices

    def problem(self, value) -> str | None:
        """What is wrong with ``value`` (already of the field's type), or None."""
        if isinstance(value, (list, tuple)):
            return next(filter(None, (self.problem(v) for v in value)), None)
        if isinstance(value, float) and not math.isfinite(value):
            return f"expected a finite number, got {value!r}"
        choices = self.allowed()
        if choices and value is not None and value not in choices:
            return f"expected one of {', '.join(map(str, choices))}, got {value!r}"
        if self.interval is None or value is None or isinstance(value, (bool, str)):
            return None
        low, high = (float(x) for x in self.interval[1:-1].split(","))
        above = value > low if self.interval[0] == "(" else value >= low
        below = value < high if self.interval[-1] == ")" else value <= high
        return None if above and below else f"expected a value in {self.interval}, got {value!r}"


def limited(default, interval: str | None = None, choices: tuple | Callable[[], tuple] = ()):
    """A dataclass field whose values are checked (see Limit) by ``check_limits``."""
    return field(default=default, metadata={"limit": Limit(interval, choices)})


def limit_of(f: dataclasses.Field) -> Limit | None:
    return f.metadata.get("limit")


def check_limits(config, name: str) -> None:
    """Raise ValueError naming ``name.field`` for the first limited field of the dataclass
    instance ``config`` whose value is out of its range or choices."""
    for f in dataclasses.fields(config):
        limit = limit_of(f)
        problem = limit.problem(getattr(config, f.name)) if limit else None
        if problem:
            raise ValueError(f"{name}: {f.name}: {problem}")
