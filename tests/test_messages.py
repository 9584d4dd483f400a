"""Wrong input gets one line naming the argument and what it expects: from the command (run
as a subprocess) and from the model API."""

import json
import os
import subprocess
import sys

import pytest
import torch

import qkv
from qkv.models import GPT, Encoder, EncoderConfig, GPTConfig, Transformer, TransformerConfig

# The command's entry point run on each argv in turn, in one process: a real command line's
# parsing, dispatch and exit status, with the start-up (torch's import, seconds) paid once.
EACH_COMMAND = """
import contextlib, io, json, sys
from qkv.cli import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    print(json.dumps([code, err.getvalue()]), flush=True)
"""


def qkv_errors(*argvs: list[str]) -> list[str]:
    """The one line each command prints on stderr, each exiting with status 2."""
    proc = subprocess.run([sys.executable, "-c", EACH_COMMAND, json.dumps(argvs)],
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    outcomes = [json.loads(line) for line in proc.stdout.splitlines()]
    assert len(outcomes) == len(argvs), proc.stderr
    for argv, (code, err) in zip(argvs, outcomes, strict=True):
        assert code == 2 and err.count("\n") == 1, (argv, code, err)
    return [err for _, err in outcomes]


def test_command_arguments_of_the_wrong_kind(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    config_dir, run_dir_file, output_dir, window = qkv_errors(
        ["train", "lm", "--config", str(tmp_path)],
        ["train", "lm", "--preset", "tiny", "--run-dir", str(a_file)],
        ["viz", "--model", "minilm", "--text", "a", "-o", str(tmp_path)],
        ["eval", "--model", "smollm2", "--window", "0"])
    assert config_dir == (
        f"qkv: error: --config {str(tmp_path)!r} is a directory; expected a TOML or JSON file\n")
    assert run_dir_file == (
        f"qkv: error: --run-dir {str(a_file)!r} is a file; expected a directory (a new one, or "
        "a run's)\n")
    assert output_dir == (
        f"qkv: error: -o/--output {str(tmp_path)!r} is a directory; expected a file name such "
        f"as {str(tmp_path / 'attention.html')!r}\n")
    assert window == "qkv: error: --window must be at least 2 tokens; got 0\n"
    assert list(tmp_path.iterdir()) == [a_file]  # nothing written


def test_inputs_that_would_waste_the_work_are_refused_first(tmp_path):
    """Each is one line naming the cause, before the slow part (a model loaded, a model built,
    training) and before anything is written."""
    tiny = ["train", "lm", "--preset", "tiny", "--run-dir", str(tmp_path / "r")]
    model = ["--model", "smollm2"]
    (steps, block_train, block_held_out, max_tokens, huge, temperature_nan, temperature_inf,
     top_p, seed, prompt, message, second_message) = qkv_errors(
        [*tiny, "--set", "train.steps=99999999999999999999999"],
        [*tiny, "--set", "model.block_size=10000000"],
        [*tiny, "--set", "model.block_size=5000"],
        [*tiny, "--set", "eval.max_tokens=8"],
        [*tiny, "--set", "model.block.d_model=1048576"],
        ["generate", *model, "--prompt", "x", "--temperature", "nan"],
        ["generate", *model, "--prompt", "x", "--temperature", "inf"],
        ["generate", *model, "--prompt", "x", "--top-p", "nan"],
        ["generate", *model, "--prompt", "x", "--seed", str(2**64)],
        ["generate", *model, "--prompt", ""],
        ["chat", *model, "--message", ""],
        ["chat", *model, "--message", "Hi", "--message", " "])
    assert steps == (
        "qkv: error: train.steps: expected a value in [1, 1e9], got 99999999999999999999999\n")
    # The tiny preset's text: 18,000 training characters, 2,000 held out.
    assert block_train == (
        "qkv: error: model.block_size=10000000 is too long for the text: its training part has "
        "18,000 tokens, and a window takes block_size + 1 (set model.block_size to at most "
        "17,998, or give a larger data.max_chars (now 20,000) or a smaller data.test_fraction "
        "(now 0.1))\n")
    assert "its held-out part has 2,000 tokens" in block_held_out
    assert "at most 1,999, or give a larger data.max_chars (now 20,000) or a larger " \
        "data.test_fraction (now 0.1))" in block_held_out
    assert max_tokens == (
        "qkv: error: eval.max_tokens=8 is less than one window of model.block_size=16 tokens; "
        "nothing would be scored\n")
    assert huge.startswith("qkv: error: the model does not fit in memory: 13,194,267,459,584 "
                           "parameters need about 211,108.3 GB to train (float32 weights, "
                           "gradients and AdamW's two moments), and ")
    assert huge.endswith(" GB is available on this machine; make the model smaller "
                         "(model.block.d_model, model.n_layer, ...)\n")
    assert not (tmp_path / "r").exists()
    assert temperature_nan == (
        "qkv: error: --temperature must be a finite number >= 0 (0 = greedy); got nan\n")
    assert temperature_inf == (
        "qkv: error: --temperature must be a finite number >= 0 (0 = greedy); got inf\n")
    assert top_p == "qkv: error: --top-p must be in (0, 1]; got nan\n"
    assert seed == f"qkv: error: --seed must be in [0, 4294967295]; got {2**64}\n"
    assert prompt == "qkv: error: --prompt is empty; give the text to continue\n"
    assert message == "qkv: error: --message is empty; nothing to answer\n"
    assert second_message == (
        "qkv: error: --message is empty (message 2 of 2); nothing to answer\n")


def test_viz_outputs_are_checked_before_the_work(tmp_path):
    a_file = tmp_path / "pictures"
    a_file.write_text("x")
    viz = ["viz", "--model", "minilm", "--text", "a", "-o", str(tmp_path / "page.html")]
    inside = str(a_file / "page.html")
    png_file, png_under_file, output_under_file = qkv_errors(
        [*viz, "--png", str(a_file)],
        [*viz, "--png", str(a_file / "sub")],
        ["viz", "--model", "minilm", "--text", "a", "-o", inside])
    assert png_file == (
        f"qkv: error: --png {str(a_file)!r}: {str(a_file)!r} is a file; expected a folder for "
        "the pictures (a new or an existing one)\n")
    assert png_under_file == (
        f"qkv: error: --png {str(a_file / 'sub')!r}: {str(a_file)!r} is a file; expected a "
        "folder for the pictures (a new or an existing one)\n")
    assert output_under_file == (
        f"qkv: error: -o/--output {inside!r} cannot be written: {str(a_file)!r} is a file, not "
        "a folder\n")
    assert sorted(tmp_path.iterdir()) == [a_file]  # no page written


def test_a_closed_pipe_ends_the_command_quietly():
    """`qkv embed ... | head -1`: the reader is gone before the output comes; the command
    stops as a Unix tool does (status 141, SIGPIPE's), with nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "qkv.cli", "embed", "--model", "minilm",
                             "A cat sleeps.", "A dog barks."], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=dict(os.environ, OMP_NUM_THREADS="1"))
    proc.stdout.close()
    assert proc.wait(timeout=300) == 141
    assert proc.stderr.read() == b""


def tiny_models():
    block = {"n_head": 2, "d_model": 8}
    gpt = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, block=block))
    encoder = Encoder(EncoderConfig(vocab_size=10, num_classes=0, max_len=8, n_layer=1,
                                    block=block))
    transformer = Transformer(TransformerConfig(
        src_vocab_size=10, tgt_vocab_size=12, block={**block, "d_ff": 16}, n_encoder_layers=1,
        n_decoder_layers=1))
    return gpt, encoder, transformer


@pytest.mark.parametrize("call, message", [
    (lambda g, e, t: g(torch.tensor([[3, 10]])),
     "idx: token ids must lie in [0, 10) (the vocabulary); got 10"),
    (lambda g, e, t: g(torch.tensor([[-1]])), "idx: token ids must lie in [0, 10)"),
    (lambda g, e, t: g(torch.zeros(1, 0, dtype=torch.long)),
     "idx must hold at least one token per row; got shape (1, 0)"),
    (lambda g, e, t: g.generate(torch.tensor([[1]]), -3), "max_new_tokens must be >= 0; got -3"),
    (lambda g, e, t: e(torch.tensor([[12]])), "ids: token ids must lie in [0, 10)"),
    (lambda g, e, t: t(torch.tensor([[1]]), torch.tensor([[12]])),
     "tgt: token ids must lie in [0, 12)"),
    (lambda g, e, t: t.generate(torch.tensor([[1]]), max_new_tokens=-1),
     "max_new_tokens must be >= 0; got -1"),
    (lambda g, e, t: qkv.nn.MultiHeadAttention(8, 2)(torch.randn(1, 3, 7)),
     "query must have shape (B, N, 8); got (1, 3, 7)"),
    (lambda g, e, t: qkv.nn.MultiHeadAttention(8, 2, kdim=6)(torch.randn(1, 3, 8),
                                                             torch.randn(1, 4, 8)),
     "key must have shape (B, N, 6); got (1, 4, 8)"),
])
def test_model_api_names_the_argument(call, message):
    with pytest.raises(ValueError) as info:
        call(*tiny_models())
    assert str(info.value) == message or str(info.value).startswith(message)
    assert "\n" not in str(info.value)
