"""Summaries streamed a block of rows at a time equal the ones computed from the whole maps,
for a prompt and for the rows generated through the KV cache after it."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.models import GPT, GPTConfig
from qkv.viz import capture
from qkv.viz.summaries import Summarizer, summarize


def _gpt(seed=0):
    torch.manual_seed(seed)
    block = {"n_head": 4, "n_kv_head": 2, "d_model": 32, "dropout": 0.0}
    cfg = GPTConfig(vocab_size=23, block_size=40, n_layer=2, block=block,
                    positions={"kind": "rope"})
    return GPT(cfg).eval()


def dense_stats(w: torch.Tensor, offset: int, top_k: int) -> dict:
    """Expected summaries of (h, Nq, Nk) weights whose query i sits at key i + offset."""
    nq, nk = w.shape[1:]
    positions = torch.arange(nq)[:, None] + offset
    gap = (positions - torch.arange(nk)[None, :]).abs().float()
    top = w.topk(min(top_k, nk), dim=-1)
    top = (torch.where(top.values > 0, top.indices, -1), top.values)
    return {"entropy": -(w * torch.log(w.clamp_min(1e-30))).sum(-1) / math.log(2),
            "distance": (w * gap).sum(-1), "sink": w[..., 0], "received": w.sum(1),
            "top_keys": top[0], "top_weights": top[1]}


def test_streamed_summaries_equal_the_whole_maps():
    model = _gpt()
    ids = torch.randint(0, 23, (1, 37), generator=torch.Generator().manual_seed(2))
    with capture(model, heads=[0, 3]) as maps, torch.no_grad():
        model(ids)
    # 2 heads x 37 keys x 4 bytes x 5 rows: the calls come in blocks of 5 rows.
    stats = summarize(model, lambda: model(ids), heads=[0, 3], top_k=4, row_bytes=2 * 37 * 4 * 5)
    assert len(stats) == 2
    for site in maps:
        expected = dense_stats(site.weights[0].float(), 0, 4)
        got = stats[site.name]
        assert got.heads == [0, 3]
        for name, value in expected.items():
            assert getattr(got, name).shape == value.shape, name
            if name == "top_keys":
                assert torch.equal(got.top_keys, value)
            else:
                assert torch.allclose(getattr(got, name), value, atol=1e-5), name
    assert torch.allclose(got.received.sum(-1), torch.full((2,), 37.0), atol=1e-4)


def test_generated_rows_append_and_extend_the_keys():
    model = _gpt(1)
    tokens = torch.randint(0, 23, (1, 9), generator=torch.Generator().manual_seed(3))
    summarizer = Summarizer(top_k=12)
    with capture(model, layers=[1], on_weights=summarizer, row_bytes=64), torch.no_grad():
        cache = model.new_cache(1, 12)
        logits = model(tokens, cache=cache)
        for _ in range(3):
            token = logits[:, -1:].argmax(-1)
            tokens = torch.cat([tokens, token], 1)
            logits = model(token, cache=cache)
    (got,) = summarizer.stats().values()
    assert got.entropy.shape == (4, 12) and got.received.shape == (4, 12)
    # The same rows from one pass over the whole sequence, without the cache.
    with capture(model, layers=[1]) as whole, torch.no_grad():
        model(tokens)
    expected = dense_stats(whole.select()[0].weights[0].float(), 0, 12)
    for name in ("entropy", "distance", "sink", "received"):
        assert torch.allclose(getattr(got, name), expected[name], atol=1e-4), name
    # Row 0 attends one key (causal): the other entries are key -1 with weight 0.
    assert (got.top_keys[:, 0, 1:] == -1).all() and (got.top_weights[:, 0, 1:] == 0).all()


def test_top_k_must_be_a_positive_int():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="top_k must be a positive int"):
            Summarizer(top_k=bad)
