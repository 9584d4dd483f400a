"""Ctrl-C or SIGTERM during `qkv train` saves the current step and says how to resume; the
resumed run gives exactly the losses of an uninterrupted one."""

import os
import signal
import subprocess
import sys

import pytest

from qkv.cli import main
from qkv.train import checkpoint

from .conftest import losses, tiny_lm
from .test_resume import wait_for_step

# Checkpoints only at the end: everything the interrupted run keeps is the interrupt's save.
STEPS = ["--set", "train.checkpoint_every=1000", "--set", "model.block.dropout=0.1"]


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_saves_the_current_step_and_the_resume_matches(tmp_path, sig, code):
    stopped = tmp_path / "stopped"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = tiny_lm(stopped, 60, *STEPS)
    argv.remove("--quiet")
    proc = subprocess.Popen([sys.executable, "-m", "qkv.cli", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(stopped, proc, 15)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    saved = checkpoint.list_checkpoints(stopped)
    assert len(saved) == 1 and checkpoint.problem_with(saved[0]) is None
    step = int(saved[0].name.split("-")[1])
    assert 15 <= step < 60
    last = err.strip().splitlines()[-1]
    assert last == (f"qkv: interrupted at step {step}/60; checkpoint {saved[0]}; continue with: "
                    f"qkv train lm --run-dir {stopped} --resume"), err

    assert main(tiny_lm(stopped, 60, *STEPS, "--resume")) == 0
    assert main(tiny_lm(tmp_path / "whole", 60, *STEPS)) == 0
    assert losses(stopped) == losses(tmp_path / "whole")
