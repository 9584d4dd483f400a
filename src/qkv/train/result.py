"""What a finished training run hands back: its directory, its losses and its figures.

``qkv train`` prints from it and ``qkv lab`` records it (``RUN/lab.json``); both get it from
the same call, ``qkv.train.run.train``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from .config import RunConfig


@dataclass
class RunResult:
    """A run trained to its ``train.steps`` (every session of it, when resumed).

    ``losses`` are the (step, training loss) records of ``metrics.jsonl``; ``throughput`` is
    the median of their rates, in ``unit`` per second (the first steps' warm-up barely moves
    it); ``peak_memory_bytes`` is this session's training peak (resident size on a CPU,
    allocated memory on a GPU). On the ranks other than 0 of a distributed run, ``model`` is
    None and ``losses`` is empty: rank 0 alone holds the whole model and writes the records.
    """

    run_dir: Path
    config: RunConfig
    evaluation: dict | None  # the final held-out figures (task.summary words them)
    steps: int
    seconds: float  # training time over every session
    first_step: int  # where this session started (> 0 when resumed)
    session_seconds: float
    unit: str  # what the throughput counts: "tok" (lm, translate) or "img" (vit)
    throughput: float | None
    peak_memory_bytes: int
    parameters: int
    is_main: bool
    model: nn.Module | None  # the trained model, whole, on rank 0
    data: Any  # the task's prepared data (its tokenizers and held-out part)
    losses: list[tuple[int, float]] = field(default_factory=list)

    def time_line(self) -> str:
        """The training time over every session, and this session's share when resumed."""
        line = f"trained {self.steps} steps in {self.seconds:.1f}s"
        if 0 < self.first_step < self.steps:
            line += (f" in all (this session: steps {self.first_step + 1}-{self.steps} in "
                     f"{self.session_seconds:.1f}s)")
        return line + f"; peak memory {self.peak_memory_bytes / 1e9:.2f} GB"
