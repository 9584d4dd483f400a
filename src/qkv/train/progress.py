"""A live progress line (loss, learning rate, throughput, ETA) and JSON-lines metrics."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ..data.atomic import write_text_atomic


def format_seconds(seconds: float) -> str:
    seconds = int(max(0, seconds))
    minutes, s = divmod(seconds, 60)
    return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def format_rate(rate: float) -> str:
    return f"{rate / 1000:.1f}k" if rate >= 1000 else f"{rate:.0f}"


MEAN_OF = 10  # "avg": the mean loss of the last 10 steps


class Progress:
    """Redraws one line on a terminal; otherwise prints a line at the first step, then every
    ``every`` steps."""

    def __init__(self, total: int, unit: str, every: int, enabled: bool, start_step: int = 0):
        self.total, self.unit, self.every, self.enabled = total, unit, max(1, every), enabled
        self.live = enabled and sys.stderr.isatty()
        self.start_step, self.start = start_step, time.perf_counter()
        self.window_start, self.window_units = self.start, 0
        self.recent: list[float] = []  # the last losses: one batch's loss is noisy

    def update(self, step: int, loss: float, lr: float, units: int) -> float:
        """Record step ``step`` (1-based); returns the throughput over the recent window."""
        self.window_units += units
        self.recent = [*self.recent[-(MEAN_OF - 1):], loss]
        now = time.perf_counter()
        rate = self.window_units / max(now - self.window_start, 1e-9)
        shown = step % self.every == 0 or step in (self.start_step + 1, self.total)
        if not self.enabled or not (self.live or shown):
            return rate
        per_step = (now - self.start) / max(1, step - self.start_step)
        eta = format_seconds(per_step * (self.total - step))
        line = (
            f"step {step}/{self.total} | loss {loss:.4f} (avg "
            f"{sum(self.recent) / len(self.recent):.4f}) | lr {lr:.2e} | "
            f"{format_rate(rate)} {self.unit}/s | ETA {eta}"
        )
        if self.live:
            sys.stderr.write("\r" + line.ljust(100) + ("\n" if step == self.total else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()
        if step % self.every == 0:
            self.window_start, self.window_units = now, 0
        return rate

    def message(self, text: str) -> None:
        if self.enabled:
            sys.stderr.write(("\n" if self.live else "") + text + "\n")
            sys.stderr.flush()


class MetricsLog:
    """``metrics.jsonl`` in the run directory: one JSON object per line, appended."""

    def __init__(self, run_dir: str | Path, enabled: bool):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled

    def records(self) -> list[dict]:
        """Every record written so far, in order (the torn last line of a killed run is
        skipped)."""
        if not self.path.exists():
            return []
        records = []
        for line in self.path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def truncate_after(self, step: int) -> None:
        """Drop the records of steps after ``step`` (a resumed run writes them again; a fresh
        one, at step 0, starts the file empty)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [record for record in self.records() if record.get("step", 0) <= step]
        write_text_atomic(self.path, "".join(json.dumps(record, sort_keys=True) + "\n"
                                             for record in kept))

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")

