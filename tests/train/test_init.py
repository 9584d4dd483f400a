"""``qkv train lm --init``: a run that starts from a pretrained checkpoint (a tiny LLaMA
directory with its own tokenizer.json, so the tests stay fast)."""

import json
import os
import re
import string
import subprocess
import sys

import pytest
import torch

from qkv import cli
from qkv.models import load_pretrained
from qkv.train import plan, run
from qkv.train.loop import Trainer

ALPHABET = string.ascii_lowercase + " .,\n"


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A random 2-layer LLaMA (grouped heads, RoPE, SwiGLU) and a character tokenizer."""
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama") / "tiny"
    vocab = {c: i for i, c in enumerate(["<unk>", "<s>", "</s>", *ALPHABET])}
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path)
    Tokenizer(models.BPE(vocab, [], unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))
    return path


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("attention is a weighted average of values.\n" * 60)
    return path


def init_argv(llama_dir, text_file, run_dir, *extra):
    return ["train", "lm", "--init", str(llama_dir), "--run-dir", str(run_dir), "--quiet",
            "--set", f"data.path={text_file}", "--set", "train.steps=2",
            "--set", "train.batch_size=2", "--set", "train.threads=1",
            "--set", "eval.max_tokens=64", "--set", "eval.max_new_tokens=4", *extra]


def test_init_run_starts_from_the_checkpoint_and_keeps_its_tokenizer(
        llama_dir, text_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(init_argv(llama_dir, text_file, run_dir, "--set", "model.window=8",
                              "--set", "model.block_size=32")) == 0
    stored = json.loads((run_dir / "config.json").read_text())
    assert stored["train"]["init"] == str(llama_dir)
    assert stored["train"]["lr"] == pytest.approx(1e-4)  # the fine-tuning default
    model_cfg, block = stored["model"], stored["model"]["block"]
    assert (model_cfg["positions"]["kind"], block["norm"], block["ffn"]) == (
        "rope", "rmsnorm", "swiglu")
    assert (block["n_kv_head"], model_cfg["window"], model_cfg["block_size"]) == (2, 8, 32)
    tokenizer = json.loads((run_dir / "tokenizer.json").read_text())
    assert tokenizer["kind"] == "pretrained" and tokenizer["eos"] == "</s>"
    # The run's model is the checkpoint's at step 0: rebuild it and compare weights.
    cfg = run.read_run_config(run_dir)
    trainer = Trainer(plan.make(run.get_task("lm"), cfg, tmp_path / "again", resume=False),
                      quiet=True)
    original, _ = load_pretrained(llama_dir)
    for name, value in original.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], value), name
    capsys.readouterr()
    assert cli.main(["eval", str(run_dir)]) == 0
    assert "perplexity" in capsys.readouterr().out
    assert cli.main(["generate", str(run_dir), "--prompt", "attention is",
                     "--max-new-tokens", "5", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("attention is")


@pytest.mark.parametrize("extra, message", [
    (["--set", "model.block.d_model=64"],
     "model.block.d_model cannot change on a pretrained checkpoint"),
    (["--set", "model.block_size=500"], "exceeds the checkpoint's context of 128"),
    (["--set", "model.block.similarity=mahalanobis"],
     "model.block.similarity='mahalanobis' adds parameters"),
    (["--resume"], "--init starts a new run"),
])
def test_init_refusals_are_one_line(llama_dir, text_file, tmp_path, capsys, extra, message):
    run_dir = tmp_path / "run"
    assert cli.main(init_argv(llama_dir, text_file, run_dir, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not run_dir.exists()  # nothing written


def test_init_is_for_lm_runs(llama_dir, tmp_path, capsys):
    code = cli.main(["train", "translate", "--init", str(llama_dir), "--run-dir",
                     str(tmp_path / "t")])
    assert code == 2 and "the 'translate' task cannot" in capsys.readouterr().err


def test_a_short_text_gets_the_longest_block_it_holds_and_the_plan_says_so(
        llama_dir, tmp_path, capsys):
    """The checkpoint's 128-token block does not fit 86 held-out tokens: the block becomes 64,
    the batch 16 windows (1,024 tokens a step), and the plan line names the setting."""
    text = tmp_path / "short.txt"
    text.write_text("attention is a weighted average of values.\n" * 20)  # 880 tokens
    run_dir = tmp_path / "run"
    assert cli.main(["train", "lm", "--init", str(llama_dir), "--run-dir", str(run_dir),
                     "--set", f"data.path={text}", "--set", "train.steps=1",
                     "--set", "train.threads=1", "--set", "eval.max_new_tokens=4"]) == 0
    stored = json.loads((run_dir / "config.json").read_text())
    assert (stored["model"]["block_size"], stored["train"]["batch_size"]) == (64, 16)
    plan_line = next(line for line in capsys.readouterr().err.splitlines()
                     if line.startswith("plan: "))
    assert "| 1,024 tokens/step x 1 steps (train.steps as set) | model.block_size=64, not 128: " \
        "the text's held-out part has 86 tokens (set model.block_size to choose) | " in plan_line
    # Resumed, the run keeps the block it was sized to.
    assert cli.main(["train", "lm", "--run-dir", str(run_dir), "--resume", "--quiet",
                     "--set", "train.steps=2"]) == 0
    assert json.loads((run_dir / "config.json").read_text())["model"]["block_size"] == 64


def test_the_readme_fine_tune_on_a_short_text_plans_a_block_it_holds(tmp_path):
    """The README's `qkv train lm --init smollm2 --set data.path=notes.txt --set
    model.window=128` on a 9 KB text: SmolLM2's default block of 256 becomes 128, 8 windows a
    step, as the plan says (the run is built, not trained: a SmolLM2 step takes a minute)."""
    words = "attention weighs every token of the sentence against the others and sums".split()
    text = tmp_path / "notes.txt"
    text.write_text("".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(10))
                            + f", line {i}.\n" for i in range(120)))
    overrides = ("train.init=smollm2", f"data.path={text}", "model.window=128",
                 "train.threads=1")
    cfg = run.configure(run.RunRequest("lm", overrides=overrides))
    the_plan = plan.make(run.get_task("lm"), cfg, tmp_path / "run", resume=False)
    trainer = Trainer(the_plan, quiet=True)
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (stored["model"]["block_size"], stored["model"]["window"]) == (128, 128)
    assert stored["train"]["batch_size"] == 8 and the_plan.tokens_per_step == 1024
    assert the_plan.parameters == plan.n_parameters(trainer.model)
    line = plan.plan_line(trainer.cfg, trainer.model, the_plan.tokens_per_step,
                          the_plan.sizing, 0, the_plan.block_note)
    assert re.match(r"plan: 134\.5M parameters \| 1,024 tokens/step x 10 steps \(.*\) \| "
                    r"model\.block_size=128, not 256: the text's held-out part has \d+ tokens "
                    r"\(set model\.block_size to choose\) \| warm-up 1 steps \|", line), line


def test_a_text_too_short_for_any_block_names_the_block_and_the_data(llama_dir, tmp_path,
                                                                    capsys):
    text = tmp_path / "short.txt"
    text.write_text("attention.\n" * 25)  # 275 tokens, 28 of them held out
    run_dir = tmp_path / "run"
    assert cli.main(["train", "lm", "--init", str(llama_dir), "--run-dir", str(run_dir),
                     "--set", f"data.path={text}"]) == 2
    assert capsys.readouterr().err == (
        "qkv: error: the text is too short to fine-tune on: its held-out part has 28 tokens, "
        "too few for model.block_size=32, the shortest it is sized to when unset; give a "
        f"longer text in data.path (now {str(text)!r}) or a larger data.test_fraction (now "
        "0.1), or set model.block_size to at most 27\n")
    assert not run_dir.exists()


def test_fine_tune_defaults_are_sized_to_the_checkpoint_and_data(llama_dir, tmp_path):
    """The command as a user runs it: no train.* settings. The steps come from the data (one
    pass of 1,024-token steps, at least 10), the warm-up is a tenth of them, every core, the
    plan before the first step, a progress line from step 1."""
    text = tmp_path / "notes.txt"
    text.write_text("attention is a weighted average of values.\n" * 600)  # 26k tokens
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "qkv.cli", "train", "lm", "--init", str(llama_dir), "--run-dir",
         str(run_dir), "--set", f"data.path={text}", "--set", "model.block_size=64"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    train = json.loads((run_dir / "config.json").read_text())["train"]
    assert (train["steps"], train["batch_size"], train["warmup_fraction"]) == (23, 16, 0.1)
    assert (train["threads"], train["checkpointing"], train["log_every"]) == (0, True, 1)
    lines = proc.stderr.splitlines()
    assert re.fullmatch(
        r"plan: [\d,]+ parameters \| 1,024 tokens/step x 23 steps \(one pass over the "
        r"23,\d+ training tokens\) \| warm-up 2 steps \| \d+ threads? \| about \d+s \| "
        r"peak about \d\.\d GB \(activation checkpointing\)", lines[0]), lines[0]
    assert lines[1].startswith("step 1/23 | loss ") and " tok/s | ETA " in lines[1]
    assert re.search(r"peak memory \d+\.\d\d GB", proc.stdout)
