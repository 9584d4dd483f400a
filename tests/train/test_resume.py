"""A run killed mid-way and resumed gives exactly the losses of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

from qkv.cli import main

from .conftest import losses, tiny_lm


def last_step(metrics) -> int:
    """The newest step in metrics.jsonl, ignoring a line still being written."""
    steps = [0]
    for line in metrics.read_text().splitlines() if metrics.exists() else []:
        try:
            steps.append(json.loads(line).get("step", 0))
        except json.JSONDecodeError:
            pass
    return max(steps)


def wait_for_step(run_dir, proc, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if last_step(run_dir / "metrics.jsonl") >= step:
            return
        time.sleep(0.002)
    raise AssertionError(f"the run ended or stalled before step {step}")


def test_resume_after_kill_matches_uninterrupted(tmp_path):
    steps = ["--set", "train.checkpoint_every=10", "--set", "model.block.dropout=0.1"]
    assert main(tiny_lm(tmp_path / "whole", 80, *steps)) == 0

    crashed = tmp_path / "crashed"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "qkv.cli", *tiny_lm(crashed, 80, *steps)], env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_step(crashed, proc, 25)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    interrupted_at = losses(crashed)[-1][0]
    assert 25 <= interrupted_at < 80

    assert main(tiny_lm(crashed, 80, *steps, "--resume")) == 0
    assert losses(crashed) == losses(tmp_path / "whole")
