"""``qkv.train.run.train``: the one call behind ``qkv train`` and ``qkv lab``, and the result
it hands back."""

import json

import pytest

from qkv import cli
from qkv.train import RunRequest, train
from qkv.train.config import ConfigError

from .conftest import tiny_lm

TINY = ("train.steps=4", "train.threads=1", "train.log_every=1")


def test_the_result_holds_the_run_s_directory_losses_and_figures(tmp_path):
    result = train(RunRequest("lm", tmp_path / "run", "tiny", overrides=TINY, quiet=True))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert result.run_dir == tmp_path / "run" and result.is_main
    assert result.losses == [(r["step"], r["loss"]) for r in records if "loss" in r]
    assert [step for step, _ in result.losses] == [1, 2, 3, 4] and result.steps == 4
    assert result.evaluation == records[-1]["eval"] and "loss" in result.evaluation
    assert result.parameters == sum(p.numel() for p in result.model.parameters())
    assert result.unit == "tok" and result.throughput > 0
    assert 0 < result.peak_memory_bytes < 24e9 and result.seconds > 0
    assert result.config.train.steps == 4
    assert result.time_line().startswith("trained 4 steps in ")


def test_a_resumed_run_s_result_counts_every_session(tmp_path):
    assert cli.main(tiny_lm(tmp_path / "run", 2, "--set", "train.checkpoint_every=1")) == 0
    result = train(RunRequest("lm", tmp_path / "run", overrides=("train.steps=4",),
                              resume=True, quiet=True))
    assert [step for step, _ in result.losses] == [1, 2, 3, 4]
    assert result.first_step == 2 and result.steps == 4
    assert result.seconds > result.session_seconds > 0
    assert "(this session: steps 3-4 in " in result.time_line()


@pytest.mark.parametrize(("request_", "message"), [
    (RunRequest("lm", None, "tiny"), r"^a run needs a run directory \(--run-dir\)$"),
    (RunRequest("lm", None, resume=True), r"^--resume needs --run-dir"),
    (RunRequest("lm", "x", resume=True, config_file="c.toml"),
     r"^--config starts a new run; --resume continues one with its stored configuration"),
    (RunRequest("lm", "x", "huge"), r"^unknown preset 'huge'; expected one of default, tiny$"),
    (RunRequest("chess", "x"), r"^unknown task 'chess'; expected one of "),
    (RunRequest("vit", "x", "tiny", overrides=("train.init=smollm2",)),
     r"^train.init \(--init\) starts lm runs .* the 'vit' task cannot$"),
])
def test_a_request_that_cannot_run_is_refused_before_anything_is_written(
        tmp_path, monkeypatch, request_, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message):
        train(request_)
    assert list(tmp_path.iterdir()) == []


def test_resume_with_config_is_one_line_from_the_command(tmp_path, capsys):
    assert cli.main(tiny_lm(tmp_path / "run", 1)) == 0
    capsys.readouterr()
    (tmp_path / "c.toml").write_text("[train]\nlr = 0.1\n")
    assert cli.main(["train", "lm", "--run-dir", str(tmp_path / "run"), "--resume",
                     "--config", str(tmp_path / "c.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--config starts a new run" in err[0]
