"""Summaries streamed a block of rows at a time equal the ones computed in float64 from the
whole maps: on the fast path (scores of the keys a causal block sees, the C loop, two
workers) and on the torch path, for a prompt and for the rows generated through the KV cache
after it."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.core.masks.rules import CausalMask, SlidingWindowMask
from qkv.engines.api import attention_result
from qkv.models import GPT, GPTConfig
from qkv.viz import capture
from qkv.viz.capture import watch
from qkv.viz.row_stats import library
from qkv.viz.summaries import Summarizer, _fast_call, _torch_call, fast_path, summarize

needs_c = pytest.mark.skipif(library() is None, reason="no C compiler for the fast path")


def _gpt(seed=0):
    torch.manual_seed(seed)
    block = {"n_head": 4, "n_kv_head": 2, "d_model": 32, "dropout": 0.0}
    cfg = GPTConfig(vocab_size=23, block_size=40, n_layer=2, block=block,
                    positions={"kind": "rope"})
    return GPT(cfg).eval()


def dense_stats(w: torch.Tensor, offset: int, top_k: int) -> dict:
    """Expected summaries of (h, Nq, Nk) weights whose query i sits at key i + offset."""
    nq, nk = w.shape[1:]
    positions = torch.arange(nq) + offset
    gap = (positions[:, None] - torch.arange(nk)[None, :]).abs().to(w.dtype)
    top = w.topk(min(top_k, nk), dim=-1)
    top = (torch.where(top.values > 0, top.indices, -1), top.values)
    previous = w.gather(2, (positions - 1).clamp(0, nk - 1).view(1, -1, 1).expand(
        w.shape[0], -1, 1))[..., 0]
    return {"entropy": -(w * torch.log(w.clamp_min(1e-300))).sum(-1) / math.log(2),
            "distance": (w * gap).sum(-1), "sink": w[..., 0],
            "previous": torch.where(positions >= 1, previous, 0.0), "received": w.sum(1),
            "top_keys": top[0], "top_weights": top[1]}


def _float64_weights(q, k, heads, nk_visible):
    """(h, Nq, Nk) float64 softmax of q·k/√d under a bottom-right causal mask (all keys when
    nk_visible is None)."""
    group = q.shape[1] // k.shape[1]
    qh = q[0, heads].double()
    kh = k[0, [h // group for h in heads]].double()
    s = qh @ kh.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if nk_visible is not None:
        nq, nk = q.shape[2], k.shape[2]
        allowed = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + nk - nq
        s = s.masked_fill(~allowed, -math.inf)
    return s.softmax(-1)


def _check(got: dict, expected: dict, atol=2e-5) -> None:
    for name, value in expected.items():
        assert got[name].shape == value.shape, name
        if name == "top_keys":
            assert torch.equal(got[name], value), name
        else:
            scale = max(1.0, float(value.abs().max()))  # distances: relative to the longest
            assert torch.allclose(got[name].double(), value, atol=atol * scale), name


@needs_c
@pytest.mark.parametrize("nq", [61, 7])  # a prompt; rows after a cache of 54 keys
@pytest.mark.parametrize("with_lse", [True, False])
def test_fast_path_skips_the_keys_after_the_diagonal_and_equals_float64(nq, with_lse):
    torch.manual_seed(1)
    nk, heads = 61, [0, 2, 3, 5]  # heads 0, 2 share key head 0; 3, 5 key head 1
    q, k = torch.randn(1, 6, nq, 16) * 2, torch.randn(1, 2, nk, 16)
    kwargs = {"mask": CausalMask(), "score_mod": None, "similarity": "dot", "scale": None}
    assert fast_path(q, k, kwargs)
    lse = attention_result(q, k, k, **kwargs).lse if with_lse else None
    blocks = []
    # 300 bytes of scores: blocks of one to a few rows, each seeing its own keys only.
    got = _fast_call(q, k, lse, kwargs, heads, 5, 300,
                     lambda hs, w, first: blocks.append((hs, w.shape[-1], first, w.clone())))
    _check(got, dense_stats(_float64_weights(q, k, heads, nk), nk - nq, 5))
    assert len(blocks) > 8
    for hs, n, first, w in blocks:
        assert n == min(nk, first + w.shape[1] + nk - nq)  # no key after the block's last row
        assert hs in ([0, 2], [3, 5])
        expected = _float64_weights(q, k, hs, nk)[:, first:first + w.shape[1], :n]
        assert torch.allclose(w.double(), expected, atol=1e-6)


@needs_c
def test_fast_path_without_a_mask_reads_every_key():
    torch.manual_seed(2)
    q, k = torch.randn(1, 4, 33, 8), torch.randn(1, 4, 33, 8)
    kwargs = {"mask": None, "scale": 0.3}
    assert fast_path(q, k, kwargs)
    got = _fast_call(q, k, None, kwargs, [1, 3], 4, 512, None)
    w = (q[0, [1, 3]].double() @ k[0, [1, 3]].double().transpose(-1, -2) * 0.3).softmax(-1)
    _check(got, dense_stats(w, 0, 4))


def test_other_masks_take_the_torch_path_with_the_same_summaries():
    torch.manual_seed(3)
    q, k = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    window = {"mask": SlidingWindowMask(4)}
    assert not fast_path(q, k, window)
    got = _torch_call(q, k, None, window, [0, 1], 3, 200, None)
    s = q[0].double() @ k[0].double().transpose(-1, -2) / math.sqrt(8)
    i, j = torch.arange(20)[:, None], torch.arange(20)[None, :]
    w = s.masked_fill(~((j <= i) & (j >= i - 4)), -math.inf).softmax(-1)
    _check(got, dense_stats(w, 0, 3))
    if library() is not None:  # and the two paths agree where both apply
        causal = {"mask": CausalMask()}
        fast = _fast_call(q, k, None, causal, [0, 1], 3, 200, None)
        _check(fast, {name: value.double() if value.is_floating_point() else value
                      for name, value in _torch_call(q, k, None, causal, [0, 1], 3, 200,
                                                     None).items()}, atol=1e-5)


def test_streamed_summaries_equal_the_whole_maps():
    model = _gpt()
    ids = torch.randint(0, 23, (1, 37), generator=torch.Generator().manual_seed(2))
    with capture(model, heads=[0, 3]) as maps, torch.no_grad():
        model(ids)
    # 2 heads x 37 keys x 4 bytes x 5 rows: blocks of at most 5 rows.
    stats = summarize(model, lambda: model(ids), heads=[0, 3], top_k=4, row_bytes=2 * 37 * 4 * 5)
    assert len(stats) == 2
    for site in maps:
        got = stats[site.name]
        assert got.heads == [0, 3]
        _check(vars(got), dense_stats(site.weights[0].double(), 0, 4), atol=1e-5)
    assert torch.allclose(got.received.sum(-1), torch.full((2,), 37.0), atol=1e-4)


def test_generated_rows_append_and_extend_the_keys():
    model = _gpt(1)
    tokens = torch.randint(0, 23, (1, 9), generator=torch.Generator().manual_seed(3))
    summarizer = Summarizer(top_k=12, row_bytes=64)
    with watch(model, summarizer, layers=[1]), torch.no_grad():
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
    expected = dense_stats(whole.select()[0].weights[0].double(), 0, 12)
    for name in ("entropy", "distance", "sink", "previous", "received"):
        assert torch.allclose(getattr(got, name).double(), expected[name], atol=1e-4), name
    # Row 0 attends one key (causal): the other entries are key -1 with weight 0.
    assert (got.top_keys[:, 0, 1:] == -1).all() and (got.top_weights[:, 0, 1:] == 0).all()


def test_top_k_must_be_a_positive_int():
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="top_k must be a positive int"):
            Summarizer(top_k=bad)
