"""The ``qkv`` command end to end on tiny presets, and its answers to bad input."""

import io
import json
import os
import stat
import subprocess
import sys
from types import SimpleNamespace

import pytest

import qkv
from qkv import cli


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("QKV_CACHE", str(tmp_path_factory.getbasetemp() / "qkv-cache"))


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def train_tiny(tmp_path_factory, task, *extra):
    run_dir = tmp_path_factory.mktemp(task) / "run"
    argv = ["train", task, "--preset", "tiny", "--run-dir", str(run_dir),
            "--set", "train.threads=1", *extra]
    assert cli.main(argv) == 0
    return run_dir


@pytest.fixture(scope="module")
def translate_run(tmp_path_factory):
    return train_tiny(tmp_path_factory, "translate")


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    return train_tiny(tmp_path_factory, "lm")


def test_train_translate_writes_a_complete_run(translate_run):
    names = {p.name for p in translate_run.iterdir()}
    assert {"config.json", "model.json", "tokenizer_src.json", "tokenizer_tgt.json",
            "metrics.jsonl", "checkpoints", "cross_attention.png"} <= names
    assert json.loads((translate_run / "config.json").read_text())["train"]["steps"] == 6
    assert (translate_run / "cross_attention.png").read_bytes()[:4] == b"\x89PNG"
    # Files get the user's umask, as `open` would give them, not a temp file's 0600.
    umask = os.umask(0o022)
    os.umask(umask)
    files = [p for p in translate_run.rglob("*") if p.is_file()]
    assert {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o666 & ~umask}


def test_eval_and_translate(translate_run, capsys, tmp_path):
    code, out, _ = run(capsys, "eval", str(translate_run))
    assert code == 0 and "exact match" in out and "BLEU" in out and "chrF" in out
    heatmap = tmp_path / "map.png"
    code, out, _ = run(capsys, "translate", str(translate_run), "zweiundvierzig", "elf",
                       "--beam-size", "2", "--heatmap", str(heatmap))
    assert code == 0 and len(out.splitlines()) == 2 and heatmap.exists()


def test_eval_takes_eval_overrides(translate_run, capsys):
    code, out, _ = run(capsys, "eval", str(translate_run), "--set", "eval.beam_size=3",
                       "--set", "eval.length_penalty=1.0")
    assert code == 0 and "beam 3)" in out
    one_line_error(capsys, ["eval", str(translate_run), "--set", "train.steps=3"],
                   "a trained run takes only eval.* overrides; got 'train.steps'")
    one_line_error(capsys, ["eval", str(translate_run), "--set", "eval.beam_siz=3"],
                   "did you mean eval.beam_size")


def test_translate_reads_stdin(translate_run, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("zweiundvierzig\nelf\ndrei\n"))
    code, out, _ = run(capsys, "translate", str(translate_run), "-", "--beam-size", "1")
    expected = cli.main(["translate", str(translate_run), "zweiundvierzig", "elf", "drei",
                         "--beam-size", "1"])
    assert code == expected == 0 and out == capsys.readouterr().out and out.count("\n") == 3
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    one_line_error(capsys, ["translate", str(translate_run), "-"], "no lines on standard input")
    one_line_error(capsys, ["translate", str(translate_run), "x", "--beam-size", "0"],
                   "eval.beam_size: expected a value in [1, inf), got 0")


def command(capsys, monkeypatch, *argv, stdin=""):
    """``qkv ARGV`` in this process with ``stdin`` as standard input: (exit status, stdout,
    stderr), whether the command returns its status or exits with it."""
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    try:
        code = cli.main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_translate_refuses_or_flags_empty_and_unknown_input(translate_run, capsys, monkeypatch):
    run_dir = str(translate_run)

    def qkv_command(*argv, stdin=""):
        return command(capsys, monkeypatch, *argv, stdin=stdin)

    empty = qkv_command("translate", run_dir, "")
    assert empty.returncode == 2 and empty.stdout == ""
    assert empty.stderr == "qkv: error: text 1 is empty; nothing to translate\n"
    emoji = qkv_command("translate", run_dir, "elf", "\U0001f600")
    assert emoji.returncode == 2 and emoji.stderr == (
        "qkv: error: text 2 has no character the model knows ('\U0001f600'); nothing to "
        "translate\n")
    mixed = qkv_command("translate", run_dir, "elf\U0001f600", "--beam-size", "1")
    assert mixed.returncode == 0 and mixed.stdout.count("\n") == 1
    assert mixed.stderr.startswith("qkv: warning: text 1 has characters the model never saw "
                                   "('\U0001f600')")
    # Standard input keeps one output line per input line: skipped lines are left empty.
    lines = qkv_command("translate", run_dir, "-", "--beam-size", "1",
                        stdin="elf\n\n\U0001f600\U0001f600\n")
    assert lines.returncode == 0 and lines.stdout.endswith("\n\n\n")
    assert lines.stdout.count("\n") == 3
    assert lines.stderr.splitlines() == [
        "qkv: line 2 is empty; its output line is left empty",
        "qkv: line 3 has no character the model knows ('\U0001f600'); its output line is left "
        "empty"]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"qkv {qkv.__version__}\n"


def test_generate_sampling_and_beam_flags(lm_run, capsys):
    outs = set()
    for flags in (["--top-k", "1"], ["--top-p", "1e-6"], ["--temperature", "0"]):
        code, out, _ = run(capsys, "generate", str(lm_run), "--prompt", "Re", "--max-new-tokens",
                           "12", "--temperature", "1.5", *flags)
        assert code == 0
        outs.add(out)
    assert len(outs) == 1  # top-k 1, a tiny top-p and greedy all pick the likeliest token
    code, out, _ = run(capsys, "generate", str(lm_run), "--prompt", "Re", "--max-new-tokens",
                       "12", "--beam-size", "3")
    assert code == 0 and out.startswith("Re") and len(out.rstrip("\n")) >= 12
    for flags, expected in ((["--top-p", "2"], "eval.top_p: expected a value in (0, 1], got 2.0"),
                            (["--top-k", "-1"], "eval.top_k: expected a value in [0, inf)"),
                            (["--beam-size", "0"], "eval.beam_size: expected a value in [1, inf)"),
                            (["--temperature", "-1"], "eval.temperature: expected a value in")):
        one_line_error(capsys, ["generate", str(lm_run), "--prompt", "Re", *flags], expected)


def test_train_lm_eval_generate(lm_run, capsys):
    code, out, _ = run(capsys, "eval", str(lm_run))
    assert code == 0 and "bits/char" in out
    code, out, _ = run(capsys, "generate", str(lm_run), "--prompt", "Return", "--max-new-tokens",
                       "40", "--temperature", "0")
    assert code == 0 and out.startswith("Return") and len(out.rstrip("\n")) >= 40


def test_the_plan_gives_the_warm_up_the_run_has(tmp_path, capsys):
    code, _, err = run(capsys, "train", "lm", "--preset", "tiny", "--run-dir",
                       str(tmp_path / "r"), "--set", "train.steps=5", "--set", "train.warmup=100")
    assert code == 0
    assert " steps (train.steps as set) | warm-up 5 steps (train.warmup=100, cut to the run) | " \
        in err.splitlines()[0]


def test_train_vit_bf16_accumulated_and_eval(tmp_path_factory, capsys):
    run_dir = train_tiny(tmp_path_factory, "vit", "--set", "train.precision=bf16",
                         "--set", "train.accumulate=2")
    assert "confusion matrix" in capsys.readouterr().out
    code, out, _ = run(capsys, "eval", str(run_dir))
    assert code == 0 and "accuracy" in out


def test_bench_runs_the_scripts_main(tmp_path, monkeypatch, capsys):
    (tmp_path / "attention_cpu.py").write_text(
        "from dataclasses import dataclass\n@dataclass\nclass Case:\n    n: int\n"
        "def main(argv):\n    print('bench', argv)\n    return 0\n")
    monkeypatch.setattr(cli, "BENCH_DIR", tmp_path)
    code, out, _ = run(capsys, "bench", "attention", "--quick")
    assert code == 0 and out == "bench ['--quick']\n"
    code, _, err = run(capsys, "bench", "train")
    assert code == 2 and "needs a source checkout" in err
    (tmp_path / "generate_cpu.py").write_text("def main(argv):\n    import no_such_package\n")
    code, _, err = run(capsys, "bench", "generate")
    assert code == 2 and err == ("qkv: error: `qkv bench generate` needs the 'no_such_package' "
                                 "package, which `make test` installs (pip install -e "
                                 "'.[dev]')\n")


@pytest.mark.parametrize("command", ["train", "eval", "generate", "translate", "bench"])
def test_help_shows_examples(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0 and "examples:\n  qkv " in capsys.readouterr().out


def one_line_error(capsys, argv, expected):
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("qkv: error: ") and expected in err, err
    return err


@pytest.mark.parametrize("content, expected", [
    (None, "does not exist"), ("", "is empty"), ("eins\tone\nzwei two\n", "line 2 has no tab"),
])
def test_bad_data_files(tmp_path, capsys, content, expected):
    path = tmp_path / "pairs.tsv"
    if content is not None:
        path.write_text(content)
    argv = ["train", "translate", "--preset", "tiny", "--run-dir", str(tmp_path / "r"),
            "--set", f"data.path={path}"]
    one_line_error(capsys, argv, expected)


def test_image_folder_with_one_class(tmp_path, capsys):
    (tmp_path / "imgs" / "only").mkdir(parents=True)
    argv = ["train", "vit", "--preset", "tiny", "--run-dir", str(tmp_path / "r"),
            "--set", f"data.path={tmp_path / 'imgs'}"]
    one_line_error(capsys, argv, "1 class folder")


@pytest.mark.parametrize("arrays, expected", [
    (None, "is not an image set: expected a NumPy .npz archive"),
    ({"pictures": [[[0.0]]], "labels": [0]},
     "has no 'images' array (it holds 'pictures', 'labels')"),
])
def test_npz_that_is_no_image_set(tmp_path, capsys, arrays, expected):
    import numpy as np

    path = tmp_path / "set.npz"
    if arrays is None:
        path.write_text("a text file")
    else:
        np.savez(path, **{name: np.array(value) for name, value in arrays.items()})
    argv = ["train", "vit", "--preset", "tiny", "--run-dir", str(tmp_path / "r"),
            "--set", f"data.path={path}"]
    assert "pickle" not in one_line_error(capsys, argv, expected)
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("item, expected", [
    ("train.step=3", "did you mean train.steps"), ("train.steps=many", "expected int"),
])
def test_bad_overrides(tmp_path, capsys, item, expected):
    one_line_error(capsys, ["train", "lm", "--preset", "tiny", "--run-dir", str(tmp_path),
                            "--set", item], expected)


@pytest.mark.parametrize("task, item, expected", [
    ("lm", "train.batch_size=0", "train.batch_size: expected a value in [1, 1e9], got 0"),
    ("lm", "train.accumulate=0", "train.accumulate: expected a value in [1, 1e9], got 0"),
    ("lm", "train.checkpoint_every=0", "train.checkpoint_every: expected a value in [1, 1e9]"),
    ("lm", "train.keep_checkpoints=0", "train.keep_checkpoints: expected a value in [1, 1e9]"),
    ("lm", "model.block_size=0", "model.block_size: expected a value in [1, inf), got 0"),
    ("lm", "train.threads=-3", "train.threads: expected a value in [0, 4096], got -3"),
    ("vit", "train.label_smoothing=2", "train.label_smoothing: expected a value in [0, 1]"),
    ("lm", "train.steps=-5", "train.steps: expected a value in [1, 1e9], got -5"),
    ("translate", "eval.beam_size=0", "eval.beam_size: expected a value in [1, inf), got 0"),
    ("lm", "train.schedule=linear", "train.schedule: expected one of cosine, noam, constant"),
    ("lm", "data.test_fraction=1.5", "data.test_fraction: expected a value in (0, 1), got 1.5"),
])
def test_config_values_checked_before_anything_is_written(tmp_path, capsys, task, item,
                                                          expected):
    run_dir = tmp_path / "r"
    one_line_error(capsys, ["train", task, "--preset", "tiny", "--run-dir", str(run_dir),
                            "--set", item], expected)
    assert not run_dir.exists()


def test_bad_run_directories(tmp_path, capsys, lm_run):
    one_line_error(capsys, ["train", "lm", "--resume", "--run-dir", str(tmp_path)],
                   "not a qkv run directory")
    one_line_error(capsys, ["train", "vit", "--resume", "--run-dir", str(lm_run)],
                   "holds a 'lm' run, not 'vit'")
    one_line_error(capsys, ["train", "lm", "--preset", "tiny", "--run-dir", str(lm_run)],
                   "already holds a run")
    one_line_error(capsys, ["translate", str(lm_run), "eins"], "holds a 'lm' run, not 'translate'")
    empty = tmp_path / "fresh"
    empty.mkdir()
    (empty / "config.json").write_text((lm_run / "config.json").read_text())
    one_line_error(capsys, ["train", "lm", "--resume", "--run-dir", str(empty)],
                   "holds no checkpoint")


def test_corrupt_checkpoints(tmp_path, capsys, lm_run):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(lm_run, copy)
    newest, older = sorted((copy / "checkpoints").iterdir(), reverse=True)
    (newest / "model.safetensors").write_bytes(b"garbage")
    code, out, err = run(capsys, "eval", str(copy))
    assert code == 0 and f"{newest} is corrupt" in err and "bits/char" in out
    (older / "trainer.pt").write_bytes(b"garbage")
    code, _, err = run(capsys, "eval", str(copy))
    assert code == 2 and err.splitlines()[-1].startswith("qkv: error: no intact checkpoint")


def test_a_corrupt_tokenizer_is_named(tmp_path, capsys, lm_run):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(lm_run, copy)
    (copy / "tokenizer.json").write_text('{"kind": "char", "chars": ')
    one_line_error(capsys, ["eval", str(copy)],
                   f"tokenizer file {str(copy / 'tokenizer.json')!r} is corrupt")


def test_a_run_missing_its_tokenizer_or_edited_after_training(tmp_path, capsys, lm_run):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(lm_run, copy)
    (copy / "tokenizer.json").unlink()
    one_line_error(capsys, ["eval", str(copy)],
                   f"tokenizer file {str(copy / 'tokenizer.json')!r} does not exist")
    shutil.copy(lm_run / "tokenizer.json", copy)
    config = json.loads((copy / "config.json").read_text())
    config["model"]["block"]["d_model"] = 64
    (copy / "config.json").write_text(json.dumps(config))
    one_line_error(capsys, ["eval", str(copy)], "does not fit the model: Error(s) in loading")


def test_the_installed_command_prints_no_traceback(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "qkv.cli", "train", "translate", "--set",
         f"data.path={tmp_path / 'missing.tsv'}", "--run-dir", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr


def test_train_on_user_files(tmp_path_factory, tmp_path, capsys):
    pairs = tmp_path / "pairs.tsv"
    pairs.write_text("".join(f"{i} Äpfel\t{i} apples\n" for i in range(40)), encoding="utf-8")
    run_dir = train_tiny(tmp_path_factory, "translate", "--set", f"data.path={pairs}",
                         "--set", "data.tokenizer=char")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data"]["path"] == str(pairs)
    assert "Ä" in json.loads((run_dir / "tokenizer_src.json").read_text())["chars"]
    # "3 apples" is 2 tokens: BLEU (4-grams) is 0 by construction, and the summary says so.
    capsys.readouterr()
    code, out, _ = run(capsys, "eval", str(run_dir))
    assert code == 0 and out.startswith("held-out exact match ") and "% | chrF " in out
    assert "| BLEU 0.0 (of little meaning here: 100% of the references are shorter than 4 " \
           "tokens, where BLEU is 0 by construction)" in out
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time there was a model. " * 60, encoding="utf-8")
    run_dir = train_tiny(tmp_path_factory, "lm", "--set", f"data.path={text}")
    code, out, _ = run(capsys, "eval", str(run_dir))
    assert code == 0 and "bits/char" in out
