"""``qkv generate | chat | embed | eval --model``: the real checkpoints from the command line."""

import io
import json
import math
import re

import pytest
import torch

import qkv.models
from qkv import cli
from qkv.models.pretrained.usage import embed_texts
from qkv.models.scoring import perplexity, token_nll

pytestmark = pytest.mark.slow  # each checkpoint loads once per module, a few seconds


@pytest.fixture(autouse=True, scope="module")
def loaded_once(load_pretrained_once):
    """Each checkpoint loads once in this module (see tests/conftest.py)."""


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_streams_the_greedy_continuation(capsys):
    prompt = "The capital of France is"
    code, out, _ = run(capsys, "generate", "--model", "smollm2", "--prompt", prompt,
                       "--max-new-tokens", "8")
    model, tok = qkv.models.load_pretrained("smollm2")
    ids = tok.encode(prompt)
    expected = model.generate(torch.tensor([ids]), 8, temperature=0)[0, len(ids):]
    assert code == 0
    assert out == prompt + tok.decode(expected.tolist()) + "\n"


def test_generate_sampling_flags_and_beam(capsys):
    base = ["generate", "--model", "smollm2", "--prompt", "Once upon a time",
            "--max-new-tokens", "6"]
    code, sampled, _ = run(capsys, *base, "--temperature", "0.8", "--top-k", "20",
                           "--top-p", "0.9", "--seed", "3")
    code2, again, _ = run(capsys, *base, "--temperature", "0.8", "--top-k", "20",
                          "--top-p", "0.9", "--seed", "3")
    assert code == code2 == 0 and sampled == again  # seeded: reproducible
    code, beam, _ = run(capsys, *base, "--beam-size", "3")
    assert code == 0 and beam.startswith("Once upon a time") and len(beam) > len(base[4]) + 1


def test_chat_applies_the_template_and_answers_each_turn(capsys, monkeypatch):
    code, out, _ = run(capsys, "chat", "--model", "smollm2", "--message",
                       "What is the capital of France?", "--max-new-tokens", "12")
    assert code == 0 and out.startswith("model> ") and "Paris" in out
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hello.\n\nName a color.\n"))
    code, out, _ = run(capsys, "chat", "--model", "smollm2", "--max-new-tokens", "6")
    assert code == 0 and out.count("model> ") == 2  # blank lines are skipped when piped


def test_embed_prints_cosines_and_json_vectors(capsys, monkeypatch):
    texts = ["A man is eating food.", "Someone is eating a meal.", "A cat sleeps."]
    code, out, _ = run(capsys, "embed", "--model", "minilm", *texts)
    rows = [line for line in out.splitlines()[1:] if line.strip()]
    assert code == 0 and len(rows) == 3
    sims = [[float(x) for x in re.findall(r"-?\d\.\d{3}", row.split("[")[0])] for row in rows]
    assert all(abs(sims[i][i] - 1) < 1e-3 for i in range(3))
    assert sims[0][1] > 0.5 > sims[0][2]
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(texts) + "\n"))
    code, out, _ = run(capsys, "embed", "--model", "minilm", "--json", "-")
    got = json.loads(out)
    model, tok = qkv.models.load_pretrained("minilm")
    want = embed_texts(model, tok, texts)
    assert code == 0 and [g["text"] for g in got] == texts
    vectors = torch.tensor([g["embedding"] for g in got])
    assert torch.allclose(vectors, want, atol=1e-6)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(3), atol=1e-5)


def test_eval_model_reports_perplexity(capsys, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("Attention is a weighted average of values. " * 20)
    code, out, _ = run(capsys, "eval", "--model", "smollm2", "--text", str(text),
                       "--window", "32", "--max-tokens", "64")
    model, tok = qkv.models.load_pretrained("smollm2")
    ids = torch.tensor(tok.encode(text.read_text(), add_special_tokens=False))[:65]
    total, count = token_nll(model, ids, 32)
    assert code == 0 and f"{count} tokens" in out
    assert f"perplexity {perplexity(total, count):.3f}" in out
    assert 1.0 < perplexity(total, count) < 10.0  # repeated text is easy to predict
    assert math.isclose(total / count, float(out.split("mean NLL ")[1].split()[0]), rel_tol=1e-3)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--model", "minilm", "--prompt", "x"], "needs a decoder checkpoint"),
    (["embed", "--model", "smollm2", "x"], "needs an encoder checkpoint"),
    (["generate", "--model", "no-such-model", "--prompt", "x"], "no such checkpoint"),
    (["generate", "runs/x", "--model", "smollm2", "--prompt", "x"], "exactly one"),
    (["eval"], "exactly one"),
    (["generate", "--model", "smollm2", "--prompt", "x", "--top-p", "0"], "--top-p"),
    (["generate", "--model", "smollm2", "--prompt", "x", "--max-new-tokens", "9000"],
     "context of 8192"),
    (["eval", "--model", "smollm2", "--window", "1"], "--window"),
    (["eval", "--model", "smollm2", "--set", "eval.beam_size=2"], "--set applies"),
    (["chat", "--model", "minilm"], "needs a decoder"),
])
def test_bad_model_input_is_one_line_and_status_2(capsys, argv, message):
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_weights_flag_is_for_checkpoints_only(capsys):
    code, _, err = run(capsys, "generate", "runs/none", "--prompt", "x", "--weights", "bf16")
    assert code == 2 and "--weights applies to --model" in err
