"""The lab's attention summaries: each layer's entropy, sink mass and distance on held-out
windows equal the same numbers computed by hand from the captured maps; differential layers
are summarized over their two softmax maps; the unigram entropy by hand; the page's table."""

import json
import math
import xml.etree.ElementTree as ET

import pytest
import torch

from qkv import cli
from qkv.data.docstrings import stdlib_docstrings
from qkv.data.text import split_text
from qkv.lab import attention
from qkv.train.rundir import load_run
from qkv.viz import capture

from ..train.conftest import tiny_lm


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Keep the docstrings cache out of the user's home."""
    monkeypatch.setenv("QKV_CACHE", str(tmp_path_factory.getbasetemp() / "qkv-cache"))


def by_hand(run_dir, windows: int) -> list[dict]:
    """Per layer: the means over heads and query rows 1.. of -Σ w log2 w, w[:, 0] and
    Σ w (i - j), from full maps captured on the first held-out windows."""
    run = load_run(run_dir)
    model, block = run.model, run.model.config.block_size
    _, test = split_text(stdlib_docstrings(run.config.data.max_chars),
                         run.config.data.test_fraction)
    ids = run.tokenizers["tokenizer"].encode(test)
    sums = {}
    for start in range(0, windows * block, block):
        with capture(model) as maps, torch.no_grad():
            model(torch.tensor([ids[start:start + block]]))
        for layer, site in enumerate(maps):
            w = site.weights[0, :, 1:].double()                     # (H, block - 1, block)
            i = torch.arange(1, block)[:, None]
            gap = (i - torch.arange(block)).clamp(min=0)
            found = (-torch.special.xlogy(w, w).sum(-1) / math.log(2), w[..., 0],
                     (w * gap).sum(-1))
            acc = sums.setdefault(layer, [0.0, 0.0, 0.0, 0])
            for k, x in enumerate(found):
                acc[k] += float(x.sum())
            acc[3] += w[..., 0].numel()
    return [{"entropy_bits": e / n, "sink": s / n, "distance": d / n}
            for e, s, d, n in sums.values()]


def test_summaries_equal_the_captured_maps_by_hand(tmp_path):
    run_dir = tmp_path / "run"
    assert cli.main(tiny_lm(run_dir, 3, "--set", "model.n_layer=2")) == 0
    got = attention.run_summary(run_dir)
    assert got["tokens"] == attention.WINDOWS * 16
    assert [layer["layer"] for layer in got["layers"]] == ["blocks.0.self_attn",
                                                          "blocks.1.self_attn"]
    for found, want in zip(got["layers"], by_hand(run_dir, attention.WINDOWS), strict=True):
        for key in attention.STATS:
            assert found[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6)
    assert json.loads((run_dir / attention.MARK).read_text()) == got  # read back on rerun


def test_differential_layers_are_summarized_over_their_softmax_maps(tmp_path):
    run_dir = tmp_path / "run"
    assert cli.main(tiny_lm(run_dir, 2, "--set", "model.block.attention=differential")) == 0
    (layer,) = attention.run_summary(run_dir)["layers"]
    assert 0 < layer["entropy_bits"] <= math.log2(16)
    assert 0 < layer["sink"] < 1 and 0 < layer["distance"] < 15


def test_unigram_entropy_by_hand():
    # Reference counts {0: 3, 1: 1} plus one each over the vocabulary {0, 1}: p = 4/6, 2/6.
    got = attention.unigram_entropy([0, 0, 1], [0, 0, 0, 1])
    assert got == pytest.approx(-(2 * math.log(4 / 6) + math.log(2 / 6)) / 3, rel=1e-12)


def test_the_lab_page_and_results_hold_the_summaries(tmp_path, capsys):
    (tmp_path / "lab.toml").write_text(
        '[lab]\ntask = "lm"\npreset = "tiny"\nset = ["train.steps=2"]\n'
        '[variants.dot]\n[variants.differential]\nset = ["model.block.attention=differential"]\n')
    out = tmp_path / "out"
    assert cli.main(["lab", str(tmp_path / "lab.toml"), "-o", str(out), "--jobs", "1",
                     "--threads", "1", "--quiet"]) == 0
    capsys.readouterr()
    results = json.loads((out / "results.json").read_text())
    assert results["unigram_entropy"] > 0
    for name in ("dot", "differential"):
        found = results["variants"][name]["attention"]
        stored = attention.run_summary(out / "runs" / f"{name}-s0")
        assert found["layers"] == stored["layers"] and found["seeds"] == 1
    text = (out / "report.html").read_text()
    assert f"{results['unigram_entropy']:.4f} nats per token" in text
    root = ET.fromstring(text.split("\n", 1)[1])
    rows = root.findall(".//table[@class='attention']/tbody/tr")
    assert [r.find("td").text for r in rows] == ["dot", "differential"]
    entropy = results["variants"]["dot"]["attention"]["layers"][0]["entropy_bits"]
    assert rows[0].findall("td")[2].text == f"{entropy:.3f}"
