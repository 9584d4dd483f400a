"""Wrong input gets one line naming the argument and what it expects: from the command (run
as a subprocess) and from the model API."""

import os
import subprocess
import sys

import pytest
import torch

import qkv
from qkv.models import GPT, Encoder, EncoderConfig, GPTConfig, Transformer, TransformerConfig


def qkv_error(*argv: str, cwd=None) -> str:
    proc = subprocess.run([sys.executable, "-m", "qkv.cli", *argv], capture_output=True,
                          text=True, timeout=300, cwd=cwd,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_command_arguments_of_the_wrong_kind(tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    assert qkv_error("train", "lm", "--config", str(tmp_path)) == (
        f"qkv: error: --config {str(tmp_path)!r} is a directory; expected a TOML or JSON file\n")
    assert qkv_error("train", "lm", "--preset", "tiny", "--run-dir", str(a_file)) == (
        f"qkv: error: --run-dir {str(a_file)!r} is a file; expected a directory (a new one, or "
        "a run's)\n")
    assert qkv_error("viz", "--model", "minilm", "--text", "a", "-o", str(tmp_path)) == (
        f"qkv: error: -o/--output {str(tmp_path)!r} is a directory; expected a file name such "
        f"as {str(tmp_path / 'attention.html')!r}\n")
    assert qkv_error("eval", "--model", "smollm2", "--window", "0") == (
        "qkv: error: --window must be at least 2 tokens; got 0\n")
    assert list(tmp_path.iterdir()) == [a_file]  # nothing written


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
