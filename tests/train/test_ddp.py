"""Two gloo processes under torchrun match one process with the same global batch."""

import os
import subprocess
import sys

import pytest

from qkv.cli import main

from .conftest import losses, tiny_lm


@pytest.mark.slow
def test_two_process_gloo_matches_one_process(tmp_path):
    args = ["--set", "train.batch_size=8", "--set", "train.accumulate=2",
            "--set", "train.checkpoint_every=100"]
    assert main(tiny_lm(tmp_path / "one", 5, *args)) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "qkv.cli", *tiny_lm(tmp_path / "two", 5, *args)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("run directory:") == 1  # only rank 0 prints
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _, _ in one] == [s for s, _, _ in two] == [1, 2, 3, 4, 5]
    for (_, a, lr_a), (_, b, lr_b) in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5) and lr_a == lr_b
