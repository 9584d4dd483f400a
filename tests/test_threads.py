"""``--threads N`` on every command, and the automatic choice on a busy machine."""

import json

import pytest
import torch

import qkv.threads
from qkv import cli

COMMANDS = ("train", "eval", "generate", "chat", "embed", "translate", "viz", "bench")


@pytest.fixture(autouse=True)
def torch_threads(monkeypatch):
    """Each test starts from torch's default of 2 threads on 2 cores and leaves the process's
    thread count as it found it."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(qkv.threads, "TORCH_DEFAULT", 2)
    monkeypatch.setattr(qkv.threads, "cores", lambda: 2)
    yield
    torch.set_num_threads(before)


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def embed(capsys, *flags):
    return run(capsys, "embed", "--model", "minilm", "A cat sleeps.", *flags)


def test_threads_sets_torchs_count(capsys):
    code, _, err = embed(capsys, "--threads", "1")
    assert code == 0 and torch.get_num_threads() == 1 and err == ""
    code, _, err = embed(capsys, "--threads", "2")
    assert code == 0 and torch.get_num_threads() == 2 and err == ""


def test_a_busy_machine_gets_fewer_threads_and_a_note(capsys, monkeypatch):
    monkeypatch.setattr(qkv.threads, "load_average", lambda: 1.6)
    code, _, err = embed(capsys)
    assert code == 0 and torch.get_num_threads() == 1
    assert err == ("qkv: the machine is busy (load average 1.6 on 2 cores): running on 1 "
                   "thread instead of 2; --threads N chooses\n")
    # --threads is the user's choice, on a busy machine too.
    code, _, err = embed(capsys, "--threads", "2")
    assert code == 0 and torch.get_num_threads() == 2 and err == ""


@pytest.mark.parametrize("load, threads", [(0.0, 2), (0.4, 2), (0.6, 1), (7.0, 1)])
def test_the_automatic_choice_leaves_out_the_cores_in_use(monkeypatch, load, threads):
    monkeypatch.setattr(qkv.threads, "load_average", lambda: load)
    chosen, note = qkv.threads.automatic()
    assert chosen == threads and (note is None) == (threads == 2)


def test_omp_num_threads_is_a_choice_already_made(monkeypatch):
    monkeypatch.setattr(qkv.threads, "load_average", lambda: 7.0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert qkv.threads.automatic() == (2, None)


def test_train_threads_is_the_runs_setting(capsys, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    code, _, _ = run(capsys, "train", "lm", "--preset", "tiny", "--run-dir", str(run_dir),
                     "--quiet", "--set", "train.steps=1", "--threads", "1")
    assert code == 0 and torch.get_num_threads() == 1
    assert json.loads((run_dir / "config.json").read_text())["train"]["threads"] == 1
    # train.threads=0 (the tiny preset's) is the automatic choice.
    monkeypatch.setattr(qkv.threads, "load_average", lambda: 3.0)
    code, _, err = run(capsys, "train", "lm", "--preset", "tiny", "--quiet", "--run-dir",
                       str(tmp_path / "busy"), "--set", "train.steps=1")
    assert code == 0 and torch.get_num_threads() == 1
    assert err.startswith("qkv: the machine is busy (load average 3.0 on 2 cores)")


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two", "5000", ""])
def test_bad_thread_counts_are_one_line_naming_the_option(capsys, command, value):
    argv = {"train": ["train", "lm"], "translate": ["translate", "runs/none", "eins"],
            "embed": ["embed", "--model", "minilm", "x"],
            "generate": ["generate", "--model", "smollm2", "--prompt", "x"]}
    if command == "bench":  # after the script's name, the arguments are the script's
        argv = ["bench", "--threads", value, "train"]
    else:
        argv = [*argv.get(command, [command, "--model", "smollm2"]), "--threads", value]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err == ("qkv: error: --threads: expected a whole number of threads in [1, 4096], "
                   f"got {value!r}\n")


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_documents_threads(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert "--threads N" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "Every command takes --threads N" in capsys.readouterr().out
