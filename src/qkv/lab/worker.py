"""One lab run: trained the way ``qkv train`` trains it, its measurements written to
``RUN/lab.json`` (the mark of a finished run), then, for lm runs, its attention summaries to
``RUN/attention.json`` (``qkv.lab.attention``), in the run's own process.

``python -m qkv.lab.worker SPEC_JSON`` runs one in a process of its own; a failure prints
``error: ...`` as its last line and exits 1, an interrupt saves a checkpoint and exits 130.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

from ..data.atomic import write_json_atomic
from ..train import config, plan, run
from ..train.interrupt import Interrupted
from ..train.loop_parts import peak_memory_bytes
from ..train.rundir import get_task
from . import attention

MARK = "lab.json"
STATUS = Path("/proc/self/status")


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over, so a run in a process that trained before measures only itself
    (on Linux, writing 5 to clear_refs resets the resident peak, VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the process's peak so far is what there is


def peak_memory(device: torch.device) -> int:
    if device.type != "cuda" and STATUS.exists():
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return peak_memory_bytes(device)


def run_config(spec: dict) -> config.RunConfig:
    threads = f"train.threads={spec['threads']}"
    if spec["resume"]:  # the stored configuration: the checkpoints were trained with it
        return run.resume_config(spec["run_dir"], spec["task"], [threads])
    task = get_task(spec["task"])
    return config.resolve(task.schema, spec["task"], task.presets[spec["preset"]], None,
                          [*spec["overrides"], threads])


def throughput(run_dir: Path) -> float | None:
    """The median of the training records' rates (units/s), which the first steps' warm-up
    barely moves."""
    rates = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "rate" in record:
            rates.append(record["rate"])
    return statistics.median(rates) if rates else None


def train(spec: dict) -> dict:
    """Train (or resume) the run ``spec`` names: {task, preset, overrides, run_dir, resume,
    threads}; returns the record written to ``RUN/lab.json``."""
    cfg = run_config(spec)
    run_dir = Path(spec["run_dir"])
    trainer = run.start(cfg, run_dir, spec["resume"], quiet=True)
    reset_peak_memory(trainer.env.device)
    result = trainer.run()
    record = {
        "result": result,
        "steps": trainer.step,
        "seconds": trainer.earlier_seconds + trainer.seconds,
        "throughput": throughput(run_dir),
        "unit": trainer.data.unit,
        "peak_memory_bytes": peak_memory(trainer.env.device),
        "parameters": plan.n_parameters(trainer.model),
    }
    write_json_atomic(run_dir / MARK, record)
    if spec["task"] == "lm":
        try:
            attention.run_summary(run_dir)
        except Exception:  # noqa: BLE001, S110 - the results retry it and report its error
            pass
    return record


def main(argv: list[str]) -> int:
    try:
        train(json.loads(argv[0]))
    except Interrupted as e:
        print(str(e), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - any failure is the run's, reported by the lab
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
