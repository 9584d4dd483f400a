"""Engines and the dispatcher that picks one.

An engine says whether it can run a problem (``why_not`` returns None, or the reason it
cannot) and runs it. ``backend="auto"`` takes the first engine, in registration order, that
can; naming a backend forces it, with a clear error when it cannot run the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..problem import Problem


@dataclass(frozen=True)
class Engine:
    name: str
    why_not: Callable[[Problem], str | None]
    run: Callable[[Problem], object]


_ENGINES: list[Engine] = []


def register(engine: Engine, *, before: str | None = None) -> None:
    """Add an engine; ``before`` places it ahead of a named one in the auto order."""
    names = [e.name for e in _ENGINES]
    if engine.name in names:
        _ENGINES[names.index(engine.name)] = engine
        return
    index = names.index(before) if before in names else len(_ENGINES)
    _ENGINES.insert(index, engine)


def engine_names() -> list[str]:
    return [e.name for e in _ENGINES]


def select(problem: Problem, backend: str = "auto") -> Engine:
    if backend == "auto":
        for engine in _ENGINES:
            if engine.why_not(problem) is None:
                return engine
        raise RuntimeError("no attention engine can run this request")  # reference always can
    for engine in _ENGINES:
        if engine.name == backend:
            reason = engine.why_not(problem)
            if reason is not None:
                raise ValueError(f"backend={backend!r} cannot run this request: {reason}")
            return engine
    raise ValueError(f"backend must be 'auto' or one of {engine_names()}; got {backend!r}")
