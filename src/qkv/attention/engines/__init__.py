"""Engines and the dispatcher that picks one.

An engine says whether it can run a problem (``why_not`` returns None, or the reason it
cannot) and runs it. ``backend="auto"`` takes the first engine in ``ENGINES`` that can;
naming a backend forces it, with a clear error when it cannot run the request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import reference
from ..problem import Problem
from . import fused_cpu, graph_gather, sdpa, triton


@dataclass(frozen=True)
class Engine:
    name: str
    why_not: Callable[[Problem], str | None]
    run: Callable[[Problem], object]


# The dispatch order, the one place it is written: ``backend="auto"`` takes the first engine
# that can run the request. SDPA only ever takes plain or causal dot products; the reference
# can run everything and comes last.
ENGINES: list[Engine] = [
    Engine("sdpa", sdpa.why_not, sdpa.run),
    Engine("triton", triton.why_not, triton.run),
    Engine("graph", graph_gather.why_not, graph_gather.run),
    Engine("fused", fused_cpu.why_not, fused_cpu.run),
    Engine("reference", lambda p: None, reference.run),
]


def engine_names() -> list[str]:
    return [e.name for e in ENGINES]


def select(problem: Problem, backend: str = "auto") -> Engine:
    if backend == "auto":
        for engine in ENGINES:
            if engine.why_not(problem) is None:
                return engine
        raise RuntimeError("no attention engine can run this request")  # reference always can
    for engine in ENGINES:
        if engine.name == backend:
            reason = engine.why_not(problem)
            if reason is not None:
                raise ValueError(f"backend={backend!r} cannot run this request: {reason}")
            return engine
    raise ValueError(f"backend must be 'auto' or one of {engine_names()}; got {backend!r}")
