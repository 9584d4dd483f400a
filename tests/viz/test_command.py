"""``qkv viz`` end to end on small run directories built the way ``qkv train`` lays them out
(config.json, model.json, tokenizers, a checkpoint), without training."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from qkv.cli import main
from qkv.viz import capture
from qkv.viz.labels import visible
from qkv.viz.page import read_page

from .runs import TEXT, make_lm_run, make_translate_run, make_vit_run, start_run


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "lm"
    model, tok = make_lm_run(run_dir, ["model.n_layer=2"])
    return run_dir, model, tok


def _page_data(path):
    return path.read_text(), read_page(path).meta


def assert_stored(stored: np.ndarray, weights: torch.Tensor, threshold: float = 0.01) -> None:
    """The page keeps weights >= threshold to 1/255 and leaves out the rest."""
    want = weights.detach().float().numpy()
    want = np.where(want >= threshold, want, 0.0)
    np.testing.assert_allclose(stored, want, atol=0.5 / 255 + 1e-6, rtol=0)


def test_lm_page_holds_the_captured_maps_and_is_self_contained(lm_run, tmp_path, capsys):
    run_dir, model, tok = lm_run
    out, pictures = tmp_path / "attention.html", tmp_path / "pictures"
    assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(out), "--png",
                 str(pictures), "--heads", "1"]) == 0
    html, data = _page_data(out)
    assert not re.search(r"<(script|link|img)[^>]+(src|href)=", html)  # nothing fetched
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert data["mode"] == "gpt"
    view = data["views"][0]
    assert view["query_tokens"] == [visible(c) for c in TEXT] and view["layers"] == [0, 1]
    assert view["heads"] == [1] and "\u2423" in view["query_tokens"]
    with capture(model.eval(), heads=[1]) as maps:
        model(torch.tensor([tok.encode(TEXT)]))
    assert_stored(read_page(out).weights(0, 1, 0), maps[1][0, 0])
    assert sorted(p.name for p in pictures.iterdir()) == [
        "gpt-self-attention-layer0.png", "gpt-self-attention-layer1.png"]
    assert "attention page:" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--text", "x" * 17], "17 tokens long but the model's context holds 16"),
    (["--text", "cat", "--layers", "2"], r"valid layers are 0\.\.1"),
    (["--text", "cat", "--heads", "0,5"], r"valid heads are 0\.\.1"),
    ([], "needs --text"),
    (["--text", "cat", "--neuron-layers", "3"], r"--neuron-layers: .* valid layers are 0\.\.1"),
    (["--text", "cat", "--layers", "0", "--neuron-layers", "1"], r"layer 1 is not captured"),
    (["--text", "cat", "--generate", "2"], "--generate works with --model"),
    (["--text", "cat", "--threshold", "0"], r"--threshold must be in \(0, 1\)"),
])
def test_bad_requests_print_one_clear_line(lm_run, tmp_path, capsys, argv, message):
    run_dir, _, _ = lm_run
    assert main(["viz", str(run_dir), "-o", str(tmp_path / "a.html"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error:") and re.search(message, err), err


def test_run_directories_without_a_model(tmp_path, capsys):
    assert main(["viz", str(tmp_path / "missing"), "--text", "a"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["viz", str(tmp_path), "--text", "a"]) == 2
    assert "not a qkv run directory" in capsys.readouterr().err
    run_dir = tmp_path / "untrained"
    start_run(run_dir, "lm")
    assert main(["viz", str(run_dir), "--text", "a"]) == 2
    assert "holds no model" in capsys.readouterr().err


def test_linear_attention_run_says_it_has_no_weights(tmp_path, capsys):
    run_dir = tmp_path / "linear"
    make_lm_run(run_dir, ["model.block.attention=linear"])
    assert main(["viz", str(run_dir), "--text", "cat", "-o", str(tmp_path / "a.html")]) == 2
    assert "no attention weights" in capsys.readouterr().err


def test_translate_page_has_encoder_decoder_and_cross_views(tmp_path):
    run_dir = tmp_path / "translate"
    make_translate_run(run_dir)
    out = tmp_path / "t.html"
    assert main(["viz", str(run_dir), "--text", "zwei", "-o", str(out)]) == 0
    _, data = _page_data(out)
    kinds = [(v["name"].split(" (")[0], v["kind"]) for v in data["views"]]
    assert kinds == [("encoder self-attention", "self"), ("decoder self-attention", "self"),
                     ("decoder cross-attention", "cross")]
    cross = data["views"][2]
    assert cross["key_tokens"] == list("zwei") and cross["query_tokens"][-1] == "<eos>"
    assert data["views"][0]["rollout"] is not None
    assert main(["viz", str(run_dir), "--text", "zweiundvierzig", "-o", str(out)]) == 2


def test_vit_page_shows_the_image_and_rollout_picture(tmp_path):
    run_dir = tmp_path / "vit"
    make_vit_run(run_dir)
    out, pictures = tmp_path / "v.html", tmp_path / "pics"
    assert main(["viz", str(run_dir), "--image", "2", "-o", str(out), "--png", str(pictures),
                 "--svg"]) == 0
    _, data = _page_data(out)
    assert data["mode"] == "vit" and data["image"]["grid"] == [2, 2]
    assert len(data["views"][0]["query_tokens"]) == 5
    assert (pictures / "vit-rollout.svg").is_file()
    assert main(["viz", str(run_dir), "--image", "9999", "-o", str(out)]) == 2


def test_neuron_view_data_follows_the_captured_layers(lm_run, tmp_path):
    run_dir, _, _ = lm_run
    out = tmp_path / "n.html"
    assert main(["viz", str(run_dir), "--text", "cat", "--layers", "1", "-o", str(out)]) == 0
    view = read_page(out).meta["views"][0]
    assert view["layers"] == [1] and [n["layer"] for n in view["neurons"]] == [0]
    assert main(["viz", str(run_dir), "--text", "cat", "--neuron-layers", "-1", "-o",
                 str(out)]) == 0
    view = read_page(out).meta["views"][0]
    assert [view["layers"][n["layer"]] for n in view["neurons"]] == [1]


def test_text_file_and_a_page_budget(lm_run, tmp_path, capsys, monkeypatch):
    """--text-file reads the text; a page over the size budget keeps each row's K largest
    weights (K the largest that fits) and says so; what it keeps is the stored weights' top K."""
    run_dir, _, _ = lm_run
    text = tmp_path / "long.txt"
    text.write_text(TEXT)
    whole, capped = tmp_path / "whole.html", tmp_path / "capped.html"
    assert main(["viz", str(run_dir), "--text-file", str(text), "-o", str(whole),
                 "--threshold", "0.001"]) == 0
    assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(tmp_path / "same.html"),
                 "--threshold", "0.001"]) == 0
    assert whole.read_text() == (tmp_path / "same.html").read_text()
    assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(tmp_path / "one.html"),
                 "--threshold", "0.001", "--max-per-row", "1"]) == 0
    capsys.readouterr()
    # Half way between one weight a row and all of them (the page's script is most of it).
    budget = ((tmp_path / "one.html").stat().st_size + whole.stat().st_size) // 2
    monkeypatch.setattr("qkv.viz.command.PAGE_BUDGET", budget)
    assert main(["viz", str(run_dir), "--text-file", str(text), "-o", str(capped),
                 "--threshold", "0.001"]) == 0
    err = capsys.readouterr().err
    k = int(re.search(r"keeps each row's (\d+) largest weights", err).group(1))
    assert capped.stat().st_size <= budget
    full, kept = read_page(whole), read_page(capped)
    assert kept.meta["max_per_row"] == k
    for layer in range(2):
        for head in range(len(full.meta["views"][0]["heads"])):
            a, b = full.weights(0, layer, head), kept.weights(0, layer, head)
            assert ((b > 0).sum(-1) <= k).all() and ((b == 0) | (b == a)).all()
            # each kept row's smallest weight is at least every weight it left out
            left = np.where(b == 0, a, 0).max(-1)
            assert (np.where(b > 0, b, 1).min(-1) >= left - 1e-6).all()
    view = kept.meta["views"][0]
    for neuron in view["neurons"]:  # the neuron view's per-entry scores follow the cut
        for head, ref in enumerate(neuron["scores"]):
            rows = kept.rows(view["maps"][neuron["layer"]][head])
            assert len(kept.array(ref)) == rows.counts.sum()
