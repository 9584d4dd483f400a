"""Engines and the dispatcher that picks one.

The protocol has no side channels. An engine answers ``plan(problem)`` with a ``Plan`` (what
it worked out, ready to run) or with the reason it cannot run the request. ``Plan.run()``
returns a ``Result``: the output, the log-sum-exp and, when asked, the weights.
``backend="auto"`` takes the first engine in ``ENGINES`` that plans the request; naming a
backend forces it, with a clear error when it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from ..core import reference
from ..core.problem import Problem
from ..core.result import Result
from . import sdpa, triton
from .cpu import cpu_flash, fused_cpu, graph_gather


class Plan(NamedTuple):
    """One engine's plan for one request; ``run()`` computes it."""

    engine: str
    run: Callable[[], Result]


@dataclass(frozen=True)
class Engine:
    name: str
    # The request -> a zero-argument runner, or the reason the engine cannot run it.
    planner: Callable[[Problem], Callable[[], Result] | str]

    def plan(self, problem: Problem) -> Plan | str:
        runner = self.planner(problem)
        return runner if isinstance(runner, str) else Plan(self.name, runner)


def checked(why_not: Callable[[Problem], str | None], run: Callable[[Problem], Result]):
    """The planner of an engine whose plan is just its checks: the reason, or ``run(p)``."""

    def planner(p: Problem):
        reason = why_not(p)
        return reason if reason is not None else (lambda: run(p))

    return planner


# The dispatch order, the one place it is written: ``backend="auto"`` takes the first engine
# that can run the request. SDPA only ever takes plain or causal dot products (and cosine, on
# CUDA); the reference can run everything and comes last. The flash engine goes before SDPA:
# it takes only plain or causal dot-product inference on AMD CPUs with AVX-512, where it is
# faster than SDPA (docs/performance.md, "CPU: flash engine").
ENGINES: list[Engine] = [
    Engine("flash", checked(cpu_flash.why_not, cpu_flash.run)),
    Engine("sdpa", sdpa.plan),
    Engine("triton", triton.plan),
    Engine("graph", checked(graph_gather.why_not, graph_gather.run)),
    Engine("fused", checked(fused_cpu.why_not, fused_cpu.run)),
    Engine("reference", reference.plan),
]


def engine_names() -> list[str]:
    return [e.name for e in ENGINES]


class Explanation(NamedTuple):
    """Which engine runs a request (``engine``), and why each engine before it refused
    (``refused``: (engine, reason) in dispatch order)."""

    engine: str
    refused: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        lines = [f"runs on: {self.engine}"]
        lines += [f"  {name}: {reason}" for name, reason in self.refused]
        return "\n".join(lines)


def explain(problem: Problem, backend: str = "auto") -> Explanation:
    """The engine ``plan`` picks for ``problem`` and the refusals of those asked before it
    (with a named ``backend``, only that engine, which raises when it cannot)."""
    if backend != "auto":
        return Explanation(plan(problem, backend).engine, ())
    refused = []
    for engine in ENGINES:
        planned = engine.plan(problem)
        if isinstance(planned, Plan):
            return Explanation(engine.name, tuple(refused))
        refused.append((engine.name, planned))
    raise RuntimeError("no attention engine can run this request")  # reference always can


def plan(problem: Problem, backend: str = "auto") -> Plan:
    """The plan of the engine that runs ``problem``: the first that can, or the one named."""
    if backend == "auto":
        for engine in ENGINES:
            planned = engine.plan(problem)
            if isinstance(planned, Plan):
                return planned
        raise RuntimeError("no attention engine can run this request")  # reference always can
    for engine in ENGINES:
        if engine.name == backend:
            planned = engine.plan(problem)
            if isinstance(planned, str):
                raise ValueError(f"backend={backend!r} cannot run this request: {planned}")
            return planned
    raise ValueError(f"backend must be 'auto' or one of {engine_names()}; got {backend!r}")


__all__ = ["ENGINES", "Engine", "Explanation", "Plan", "Result", "engine_names", "explain",
           "plan"]
