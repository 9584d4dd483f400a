"""Capture of differential attention: head h's map is A_2h − λ A_2h+1, the formula's, from
the layer's one fused call; a GPT of differential layers gives one such map per head, and its
page stores them."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import qkv
from qkv.cli import main
from qkv.models import GPT, GPTConfig
from qkv.nn import DifferentialAttention
from qkv.train import checkpoint
from qkv.viz import capture
from qkv.viz.page import read_page

from ..nn.test_differential import formula
from .runs import TEXT, make_lm_run
from .test_command import assert_stored


def test_captured_heads_are_the_formulas_difference_maps():
    torch.manual_seed(0)
    holder = nn.Module()
    holder.self_attn = m = DifferentialAttention(32, 4, depth=2, n_kv_head=2).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    with capture(holder, heads=[3, 1]) as maps, torch.no_grad():
        out, returned = m(x, mask=qkv.causal(), return_weights=True)
    got = maps[0]
    _, diff = formula(m, x, torch.ones(9, 9, dtype=torch.bool).tril())
    assert got.shape == (2, 2, 9, 9)
    torch.testing.assert_close(got, diff[:, [1, 3]].detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got, returned[:, [1, 3]], rtol=1e-10, atol=1e-12)
    assert (got < 0).any()  # a difference, not one softmax map


def test_a_differential_gpt_gives_one_map_per_head_whose_rows_sum_to_one_less_lambda():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=30, block_size=16, n_layer=2,
                          block={"d_model": 32, "n_head": 2, "attention": "differential"}))
    model.eval()
    with capture(model) as maps, torch.no_grad():
        model(torch.randint(0, 30, (1, 12)))
    for layer, block in enumerate(model.blocks):
        w = maps[layer]
        lam = float(block.self_attn.lambda_full().detach())
        assert w.shape == (1, 2, 12, 12)
        torch.testing.assert_close(w.sum(-1), torch.full((1, 2, 12), 1 - lam),
                                   rtol=1e-5, atol=1e-5)
        assert torch.all(w.triu(1) == 0)  # causal: no weight on later keys


def test_the_page_of_a_differential_run_stores_the_difference_maps(tmp_path, capsys):
    run_dir, out = tmp_path / "run", tmp_path / "attention.html"
    model, tok = make_lm_run(run_dir, ["model.block.attention=differential"])
    with torch.no_grad():  # peaked maps, so that A_2h+1 outweighs A_2h somewhere
        for block in model.blocks:
            block.self_attn.q_proj.weight.mul_(40)
    checkpoint.save(run_dir, 2, model, {}, keep=1)
    assert main(["viz", str(run_dir), "--text", TEXT, "-o", str(out)]) == 0
    capsys.readouterr()
    page = read_page(out)
    with capture(model.eval()) as maps, torch.no_grad():
        model(torch.tensor([tok.encode(TEXT)]))
    assert (maps[0] < 0).any()
    for head in (0, 1):  # the positive weights of A_2h − λ A_2h+1, as the page keeps them
        assert_stored(page.weights(0, 0, head), maps[0][0, head])
    summary = np.array(page.meta["views"][0]["summary"])
    assert np.isfinite(summary).all()
