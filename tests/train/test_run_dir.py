"""A run directory survives what users do to it: bad resumes, failed starts, kills in the
middle of a save, reruns after a kill, and a loss that turns NaN."""

import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli import main
from qkv.train import checkpoint
from qkv.train.tasks import TASKS

from .conftest import losses, tiny_lm


def snapshot(folder) -> dict:
    """Every file and folder under ``folder`` with its bytes (None for folders)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted 12-step run, checkpointed every 4 steps."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    assert main(tiny_lm(run_dir, 12, "--set", "train.checkpoint_every=4")) == 0
    return run_dir


def error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: ") and err.count("\n") == 1, err
    return err


def test_a_resume_that_changes_the_model_is_refused_before_writing(whole, capsys):
    before = snapshot(whole)
    argv = tiny_lm(whole, 12, "--resume", "--set", "model.block.d_model=64")
    assert main(argv) == 2
    assert "--resume cannot change model.block.d_model (the run was trained with 32)" in (
        error_line(capsys))
    assert main(tiny_lm(whole, 12, "--resume", "--set", "data.tokenizer=bpe")) == 2
    assert "--resume cannot change data.tokenizer" in error_line(capsys)
    assert snapshot(whole) == before
    assert main(["eval", str(whole)]) == 0 and "bits/char" in capsys.readouterr().out


def test_failed_starts_leave_the_directory_as_it_was(tmp_path, whole, capsys):
    missing = tmp_path / "missing.txt"
    assert main(tiny_lm(tmp_path / "a", 4, "--set", f"data.path={missing}")) == 2
    assert "does not exist" in error_line(capsys) and not (tmp_path / "a").exists()
    # The data decides the image size (8), which a patch of 3 cannot tile.
    argv = ["train", "vit", "--preset", "tiny", "--run-dir", str(tmp_path / "b"),
            "--set", "model.patch_size=3"]
    assert main(argv) == 2
    assert "not divisible by patch_size" in error_line(capsys) and not (tmp_path / "b").exists()

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "model.json", "tokenizer.json", "metrics.jsonl"):
        (broken / name).write_bytes((whole / name).read_bytes())
    (broken / "checkpoints" / "step-000004").mkdir(parents=True)  # no manifest: corrupt
    before = snapshot(broken)
    assert main(tiny_lm(broken, 12, "--resume", "--set", "train.steps=20")) == 2
    assert "no intact checkpoint" in capsys.readouterr().err
    assert snapshot(broken) == before


KILL_DURING_SAVE = """
import os, signal, sys
from qkv.train import checkpoint
from qkv.cli import main

write_atomic = checkpoint.write_atomic

def write_then_die(path, write):
    # The weights of step 8 are on disk in the partial folder; trainer.pt never will be.
    if path.name == "trainer.pt" and "step-000008" in path.parent.name:
        os.kill(os.getpid(), signal.SIGKILL)
    return write_atomic(path, write)

checkpoint.write_atomic = write_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_a_kill_during_a_save_is_cleaned_up_and_resumed(tmp_path, whole, capsys):
    run_dir = tmp_path / "killed"
    argv = tiny_lm(run_dir, 12, "--set", "train.checkpoint_every=4")
    proc = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, *argv],
                          env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    (partial,) = (run_dir / "checkpoints").glob(".step-000008.partial-*")
    assert (partial / "model.safetensors").is_file() and not (partial / "trainer.pt").exists()
    assert [p.name for p in checkpoint.list_checkpoints(run_dir)] == ["step-000004"]

    assert main(tiny_lm(run_dir, 12, "--set", "train.checkpoint_every=4", "--resume")) == 0
    out, err = capsys.readouterr()
    assert f"qkv: removed {partial}, a checkpoint a killed run left unfinished" in err
    assert not partial.exists()
    assert not list((run_dir / "checkpoints").glob(".*"))
    assert losses(run_dir) == losses(whole)
    # The total covers both sessions; this session ran steps 5-12.
    assert "trained 12 steps in " in out and " in all (this session: steps 5-12 in " in out


def test_a_rerun_after_a_kill_before_the_first_checkpoint_starts_afresh(
        tmp_path, whole, monkeypatch, capsys):
    run_dir = tmp_path / "early"

    def killed(self):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr("qkv.train.loop.Trainer.save", killed)
        assert main(tiny_lm(run_dir, 12, "--set", "train.checkpoint_every=4")) == 130
    assert [s for s, _, _ in losses(run_dir)] == [1, 2, 3, 4]
    assert not checkpoint.list_checkpoints(run_dir)
    capsys.readouterr()

    before = snapshot(run_dir)
    argv = ["train", "vit", "--preset", "tiny", "--run-dir", str(run_dir)]
    assert main(argv) == 2
    assert "holds a 'lm' run stopped before its first checkpoint; pick a new --run-dir for a " \
           "'vit' run" in error_line(capsys)
    assert snapshot(run_dir) == before

    assert main(tiny_lm(run_dir, 12, "--set", "train.checkpoint_every=4")) == 0
    err = capsys.readouterr().err
    assert "held a run stopped before its first checkpoint; started it afresh" in err
    assert losses(run_dir) == losses(whole)  # steps 1-4 once, not twice


def test_files_of_a_run_that_is_not_a_qkv_run_are_not_overwritten(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"mine": true}')
    assert main(tiny_lm(tmp_path, 4)) == 2
    assert "holds config.json but no readable qkv run" in error_line(capsys)
    assert snapshot(tmp_path) == {"config.json": b'{"mine": true}'}


def test_a_non_finite_loss_stops_training_before_a_checkpoint(tmp_path, monkeypatch, capsys):
    task = TASKS["lm"]
    calls = []

    def poisoned(model, batch, train_cfg):
        calls.append(1)
        loss = type(task).loss_sum(task, model, batch, train_cfg)
        return loss * float("nan") if len(calls) == 6 else loss

    monkeypatch.setattr(task, "loss_sum", poisoned)
    run_dir = tmp_path / "nan"
    assert main(tiny_lm(run_dir, 12, "--set", "train.checkpoint_every=1")) == 2
    err = error_line(capsys)
    assert "training stopped at step 6: the loss is nan; the weights were not updated and its " \
           "newest checkpoint is step-000005" in err
    assert [s for s, _, _ in losses(run_dir)] == [1, 2, 3, 4, 5]
    saved = checkpoint.list_checkpoints(run_dir)
    assert [p.name for p in saved] == ["step-000005", "step-000004"]
    weights = load_file(saved[0] / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
