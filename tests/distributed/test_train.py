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


def _torchrun(run_dir, steps: int, *extra: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         "-m", "qkv.cli", *tiny_lm(run_dir, steps, *extra)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.slow
def test_context_parallel_run_resumes_where_it_stopped(tmp_path):
    """A context-parallel run resumed from its step-6 checkpoint (the later one removed, as
    after a crash) writes the same steps 7 to 12 as the run that never stopped."""
    import shutil

    from qkv.train.checkpoint import list_checkpoints

    args = ["--set", "train.checkpoint_every=6", "--set", "train.context_parallel=2"]
    _torchrun(tmp_path / "whole", 12, *args)
    shutil.copytree(tmp_path / "whole", tmp_path / "crashed")
    newest, older = list_checkpoints(tmp_path / "crashed")[:2]
    assert newest.name.endswith("12") and older.name.endswith("6")
    shutil.rmtree(newest)
    _torchrun(tmp_path / "crashed", 12, *args, "--resume")
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "crashed")
    assert [s for s, _, _ in resumed] == list(range(1, 13))
    for (_, a, _), (_, b, _) in zip(whole, resumed, strict=True):
        assert b == pytest.approx(a, rel=1e-6)
