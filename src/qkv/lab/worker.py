"""One lab run: trained the way ``qkv train`` trains it, its measurements written to
``RUN/lab.json`` (the mark of a finished run), then, for lm runs, its attention summaries to
``RUN/attention.json`` (``qkv.lab.attention``), in the run's own process.

``python -m qkv.lab.worker SPEC_JSON`` runs one in a process of its own; a failure prints
``error: ...`` as its last line and exits 1, an interrupt saves a checkpoint and exits 130.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..data.atomic import write_json_atomic
from ..train import run
from ..train.interrupt import Interrupted
from . import attention

MARK = "lab.json"


def train(spec: dict) -> dict:
    """Train (or resume) the run ``spec`` names: {task, preset, overrides, run_dir, resume,
    threads}, as ``qkv train`` does; returns the record written to ``RUN/lab.json``."""
    run_dir = Path(spec["run_dir"])
    request = run.RunRequest(spec["task"], run_dir, spec["preset"],
                             overrides=(*spec["overrides"], f"train.threads={spec['threads']}"),
                             resume=spec["resume"], quiet=True)
    result = run.train(request)
    record = {
        "result": result.evaluation,
        "steps": result.steps,
        "seconds": result.seconds,
        "throughput": result.throughput,
        "unit": result.unit,
        "peak_memory_bytes": result.peak_memory_bytes,
        "parameters": result.parameters,
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
