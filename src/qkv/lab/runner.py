"""Every variant for every seed: which runs are finished, which resume, which start; run
them in this process or in parallel processes, with a progress line and clean stops.

A run is finished when ``RUN/lab.json`` exists; one with a checkpoint resumes from it; any
other starts afresh. Ctrl-C stops every run at its current step (each saves a checkpoint)
and raises ``LabInterrupted``; running the lab again continues.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .. import threads
from ..train import checkpoint
from ..train.config import ConfigError, flatten
from ..train.rundir import read_run_config
from . import worker
from .labfile import Lab, Variant

POLL_S = 0.5


class LabInterrupted(KeyboardInterrupt):
    """The lab stopped on a signal; every run saved what it had."""


@dataclass
class Run:
    variant: Variant
    seed: int
    run_dir: Path
    steps: int

    @property
    def name(self) -> str:
        return self.run_dir.name

    def finished(self) -> bool:
        return (self.run_dir / worker.MARK).is_file()

    def step(self) -> int:
        """The last step recorded in its metrics (0 before any)."""
        try:
            lines = (self.run_dir / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return 0
        for line in reversed(lines):
            try:
                return int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError):
                continue  # a line being written
        return 0

    def spec(self, lab: Lab, n_threads: int) -> dict:
        return {"task": lab.task, "preset": lab.preset, "run_dir": str(self.run_dir),
                "overrides": [*self.variant.overrides, f"train.seed={self.seed}"],
                "resume": bool(checkpoint.list_checkpoints(self.run_dir)),
                "threads": n_threads}


def check_unchanged(lab: Lab, run: Run) -> None:
    """A run directory trained from another version of the lab file is refused, naming the
    first key that differs: its numbers would not be this lab's."""
    if not (run.run_dir / "config.json").is_file():
        return
    stored = flatten(read_run_config(run.run_dir, lab.task).to_dict(), "")
    wanted = flatten(lab.run_config(run.variant, run.seed).to_dict(), "")
    for key in sorted(set(stored) | set(wanted)):
        if key != "train.threads" and stored.get(key) != wanted.get(key):
            raise ConfigError(
                f"{run.run_dir} was trained with {key}={stored.get(key)!r}, the lab file now "
                f"gives {wanted.get(key)!r}; restore the file or pick a new -o DIR")


def plan_runs(lab: Lab, out: Path) -> list[Run]:
    """The runs in order (seed by seed, each seed's variants in the file's order), each
    checked against what its directory already holds."""
    runs = []
    for seed in lab.seeds:
        for variant in lab.variants:
            steps = lab.run_config(variant, seed).train.steps
            r = Run(variant, seed, out / "runs" / f"{variant.name}-s{seed}", steps)
            check_unchanged(lab, r)
            runs.append(r)
    return runs


def share_cores(pending: int, jobs: int | None, n_threads: int | None) -> tuple[int, int]:
    """(parallel runs, threads each): by default as many runs as free cores, one thread
    each, and the spare cores shared out when there are fewer runs than cores."""
    free = threads.automatic()[0] if not n_threads or not jobs else n_threads * jobs
    jobs = jobs or max(1, min(pending, free // (n_threads or 1)))
    return jobs, n_threads or max(1, free // jobs)


class Progress:
    """``lab: 3/8 runs done | dot-s1 step 40/300 | ETA 2m10s`` on stderr: rewritten in place on
    a terminal, else a line each time a run ends."""

    def __init__(self, runs: list[Run], quiet: bool):
        self.runs, self.quiet = runs, quiet
        self.tty = sys.stderr.isatty()
        self.start_steps = sum(r.steps if r.finished() else r.step() for r in runs)
        self.started = time.monotonic()
        self.active: list[Run] = []
        self.lock = threading.Lock()

    def eta(self, done_steps: int) -> str:
        total = sum(r.steps for r in self.runs)
        advanced = done_steps - self.start_steps
        if advanced <= 0:
            return "?"
        left = (total - done_steps) * (time.monotonic() - self.started) / advanced
        return f"{int(left // 60)}m{int(left % 60):02d}s"

    def line(self) -> str:
        done = sum(r.finished() for r in self.runs)
        steps = {r.name: r.step() for r in self.active}
        done_steps = sum(r.steps if r.finished() else steps.get(r.name, r.step())
                         for r in self.runs)
        now = ", ".join(f"{r.name} step {steps[r.name]}/{r.steps}" for r in self.active)
        return (f"lab: {done}/{len(self.runs)} runs done" + (f" | {now}" if now else "")
                + f" | ETA {self.eta(done_steps)}")

    def show(self, ended: bool = False) -> None:
        if self.quiet or not (self.tty or ended):
            return
        with self.lock:
            text = self.line()
            print(f"\r\033[K{text}" if self.tty else text, end="" if self.tty else "\n",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty and not self.quiet:
            print(file=sys.stderr, flush=True)


def error_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return errors[-1][len("error: "):] if errors else (lines[-1] if lines else "failed")


def tick(progress: Progress, stop: threading.Event) -> None:
    """Show the progress line each second until ``stop`` is set."""
    while not stop.wait(1.0):
        progress.show()


def run_here(lab: Lab, pending: list[Run], progress: Progress, n_threads: int) -> dict:
    """One run after another in this process; {run name: error} of those that failed."""
    failures = {}
    for r in pending:
        progress.active = [r]
        stop = threading.Event()
        ticker = threading.Thread(target=tick, args=(progress, stop), daemon=True)
        ticker.start()
        try:
            worker.train(r.spec(lab, n_threads))
        except KeyboardInterrupt:
            raise LabInterrupted from None
        except Exception as e:  # noqa: BLE001 - a failing variant is reported, the rest go on
            failures[r.name] = str(e).splitlines()[0] if str(e) else type(e).__name__
        finally:
            stop.set()
            ticker.join()
        progress.show(ended=True)
    progress.active = []
    return failures


def run_parallel(lab: Lab, pending: list[Run], progress: Progress, jobs: int,
                 n_threads: int, logs: Path) -> dict:
    """Up to ``jobs`` runs at a time, each in a process of its own (its output in
    ``logs/RUN.log``); {run name: error} of those that failed."""
    logs.mkdir(parents=True, exist_ok=True)
    queue, procs, failures = list(pending), {}, {}
    try:
        while queue or procs:
            while queue and len(procs) < jobs:
                r = queue.pop(0)
                with open(logs / f"{r.name}.log", "w") as log:
                    # A session of its own: Ctrl-C reaches the lab, which passes it on once.
                    procs[r.name] = (r, subprocess.Popen(
                        [sys.executable, "-m", "qkv.lab.worker",
                         json.dumps(r.spec(lab, n_threads))],
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            progress.active = [r for r, _ in procs.values()]
            time.sleep(POLL_S)
            for name, (r, proc) in list(procs.items()):
                if proc.poll() is None:
                    continue
                del procs[name]
                if proc.returncode != 0:
                    failures[name] = error_line(logs / f"{name}.log")
                progress.active = [r for r, _ in procs.values()]
                progress.show(ended=True)
            progress.show()
    except KeyboardInterrupt:
        for _, proc in procs.values():
            proc.send_signal(signal.SIGINT)
        for _, proc in procs.values():
            proc.wait()
        raise LabInterrupted from None
    return failures


def run_all(lab: Lab, runs: list[Run], out: Path, jobs: int | None, n_threads: int | None,
            quiet: bool) -> dict:
    """Train every unfinished run; {run name: error} of the runs that failed."""
    pending = [r for r in runs if not r.finished()]
    if not pending:
        return {}
    jobs, n_threads = share_cores(len(pending), jobs, n_threads)
    progress = Progress(runs, quiet)
    if not quiet:
        print(f"lab: {len(pending)} of {len(runs)} runs to train, {jobs} at a time on "
              f"{n_threads} thread{'s' if n_threads > 1 else ''} each", file=sys.stderr)
    try:
        if jobs == 1:  # no process to start: the run's imports and data are this process's
            return run_here(lab, pending, progress, n_threads)
        return run_parallel(lab, pending, progress, jobs, n_threads, out / "logs")
    finally:
        progress.close()
