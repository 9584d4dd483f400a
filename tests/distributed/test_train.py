"""``qkv train lm`` with train.context_parallel=2 on two gloo ranks follows one process."""

import os
import subprocess
import sys

import pytest

from qkv.cli import main

from ..train.conftest import losses, private_cache, tiny_lm  # noqa: F401  (a fixture)


@pytest.mark.slow
def test_context_parallel_training_matches_one_process(tmp_path):
    args = ["--set", "train.checkpoint_every=100"]
    assert main(tiny_lm(tmp_path / "one", 20, *args)) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "qkv.cli", *tiny_lm(tmp_path / "two", 20, *args,
                                   "--set", "train.context_parallel=2")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _, _ in two] == list(range(1, 21))
    for (_, a, _), (_, b, _) in zip(one, two, strict=True):
        assert b == pytest.approx(a, rel=1e-5)
