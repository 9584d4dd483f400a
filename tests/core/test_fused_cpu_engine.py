"""The fused CPU engine's own behaviour: tile skipping at block boundaries, empty rows,
dispatch, dropout, multi-worker runs, returned weights and the O(N) memory property."""

import json
import subprocess
import sys
import threading
import time

import pytest
import torch

import qkv
from qkv.core import EMPTY, FULL
from qkv.core.problem import build_problem
from qkv.core.similarity import DOT
from qkv.engines import plan
from qkv.engines.cpu import fused_backward, graph_gather, native_blocks, tiles, workers
from qkv.engines.cpu.tiles import TileSpec, block_sizes, tile_plan
from qkv.engines.lowering import Lowered

from .conftest import rand_qkv, rel_err

pytestmark = pytest.mark.usefixtures("one_thread")


def spec_for(mask, nq, nk, block_q, block_k, batch=1, heads=1):
    return TileSpec(Lowered(DOT, None, mask, None), batch, heads, nq, nk, 0.0, 0, block_q, block_k)


def test_causal_plan_skips_empty_and_unmasks_full_tiles():
    # Nq = Nk = 21 with 4x8 tiles: neither is a multiple of the block size.
    plan = tile_plan(spec_for(qkv.causal(), 21, 21, 4, 8), "cpu")
    for i, row in enumerate(plan):
        last_q = min(21, 4 * (i + 1)) - 1
        assert [k0 for k0, _, _ in row] == list(range(0, last_q + 1, 8))  # right of it: skipped
        for k0, k1, masked in row:
            assert k1 == min(21, k0 + 8)
            assert masked == (k1 - 1 > 4 * i)  # only tiles crossing the diagonal are masked


def test_plans_are_kept_per_rule_shape_and_tiling():
    """Causal and window plans are made once per shape and tiling; a segments mask's while
    its tensor is unchanged."""
    plan = tile_plan(spec_for(qkv.causal(), 45, 45, 8, 8), "cpu")
    assert tile_plan(spec_for(qkv.causal(), 45, 45, 8, 8), "cpu") is plan
    assert tile_plan(spec_for(qkv.causal(), 45, 45, 8, 16), "cpu") is not plan
    wider = spec_for(qkv.causal(), 45, 45, 8, 8)
    wider.span_k = 32
    assert tile_plan(wider, "cpu") != plan
    window = tile_plan(spec_for(qkv.sliding_window(9), 45, 45, 8, 8), "cpu")
    assert window != plan
    assert tile_plan(spec_for(qkv.sliding_window(9), 45, 45, 8, 8), "cpu") is window
    ids = torch.arange(45) // 10
    segments = tile_plan(spec_for(qkv.segments(ids), 45, 45, 8, 8), "cpu")
    assert tile_plan(spec_for(qkv.segments(ids), 45, 45, 8, 8), "cpu") is segments
    ids[:20] = 0  # in place: two documents become one
    assert tile_plan(spec_for(qkv.segments(ids), 45, 45, 8, 8), "cpu") != segments


def test_a_segments_mask_changed_in_place_between_calls_is_followed():
    """The kept plans never serve a tensor written in place: each call matches float64."""
    q, k, v = rand_qkv(1, 2, 2, 64, 64, 16, 16)
    ids = torch.arange(64) // 16
    for step in range(3):
        mask = qkv.segments(ids)
        out = qkv.attention(q, k, v, mask=mask, backend="fused")
        assert rel_err(out, qkv.attention(q, k, v, mask=mask, backend="reference")) < 1e-12
        ids[16 * step:16 * step + 24] = 7 + step  # documents merged, then split anew


def test_plan_merges_neighbouring_blocks_up_to_the_span():
    # Causal, Nq = Nk = 40, 8x8 blocks, spans up to 16: query block 4 (rows 32-39) sees key
    # blocks 0-3 full and block 4 on the diagonal.
    spec = spec_for(qkv.causal(), 40, 40, 8, 8)
    spec.span_k = 16
    assert list(tile_plan(spec, "cpu")[4]) == [(0, 16, False), (16, 32, False), (32, 40, True)]
    window = spec_for(qkv.sliding_window(16), 40, 40, 8, 8)
    window.span_k = 32  # rows 32-39 see keys 16-39: block 2 partial, 3 full, 4 diagonal
    assert list(tile_plan(window, "cpu")[4]) == [(16, 40, True)]
    window.span_k = 8
    assert list(tile_plan(window, "cpu")[4]) == [(16, 24, True), (24, 32, False), (32, 40, True)]
    unmasked = spec_for(None, 8, 40, 8, 8)
    unmasked.span_k = 16
    assert list(tile_plan(unmasked, "cpu")[0]) == [(0, 16, False), (16, 32, False), (32, 40, False)]


def test_plan_treats_tile_full_only_when_full_for_every_batch_element():
    mask = qkv.padding([21, 12])  # batch 1 ends mid-way through key block 1
    states = mask.tile_states(2, 1, 5, 21, 4, 8)
    assert states[0, 0, 0].tolist() == [FULL, FULL, FULL]
    assert states[1, 0, 0].tolist() == [FULL, 1, EMPTY]
    plan = tile_plan(spec_for(mask, 5, 21, 4, 8, batch=2), "cpu")
    assert list(plan[0]) == [(0, 8, False), (8, 16, True), (16, 21, True)]


@pytest.mark.parametrize("n", [1, 7, 16, 33])
@pytest.mark.parametrize("block", [(4, 8), (16, 16)])
def test_mixed_tiles_at_block_boundaries(monkeypatch, n, block):
    """Segments whose edges fall inside and on tile edges, plus an empty batch element."""
    monkeypatch.setattr(tiles, "BLOCK_Q", block[0])
    monkeypatch.setattr(tiles, "BLOCK_K", block[1])
    monkeypatch.setattr(tiles, "SPAN_K", 2 * block[1])
    ids = torch.arange(n) * 3 // max(n, 1)
    mask = qkv.segments(ids) & qkv.padding([n, 0]) & qkv.sliding_window(5, 2)
    q, k, v = rand_qkv(2, 2, 1, n, n, 4, 3, requires_grad=True)
    out = qkv.attention(q, k, v, mask=mask, score_mod=qkv.alibi(2), backend="fused")
    ref = qkv.attention(q, k, v, mask=mask, score_mod=qkv.alibi(2), backend="reference")
    assert rel_err(out, ref) < 1e-12
    upstream = 1 + ref.detach()  # d(loss)/d(out) of both losses below
    grads = torch.autograd.grad(out.sum() + (out * ref.detach()).sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.sum() + (ref * ref.detach()).sum(), (q, k, v))
    # The terms each gradient sums are at most |dO| |v| max(|q|, |k|) in size.
    terms = upstream.norm() * v.detach().norm() * max(q.detach().norm(), k.detach().norm())
    for g, r in zip(grads, ref_grads, strict=True):
        assert_close_to_rounding(g, r, terms)


def assert_close_to_rounding(got, want, terms, rtol=1e-10):
    """|got - want| <= rtol |want| plus float64 rounding of terms of size ``terms``. With one
    key (n = 1) a row's softmax weight is 1, so its dq and dk are exactly 0 in the reference
    (p (dp - sum(p dp)) = dp - dp), and a rounding of 0 in the engine (±1e-16 on an Ice Lake),
    whose backward takes delta = sum(dO out) and dp = dO v^T from different sums."""
    err = (got.detach().double() - want.detach().double()).norm()
    assert err <= rtol * want.detach().double().norm() + 1e-14 * float(terms), float(err)


@pytest.mark.parametrize("similarity", ["dot", "l2", "l1"])
@pytest.mark.parametrize("reads_tensor", [False, True])
def test_modifier_that_ignores_the_score(monkeypatch, similarity, reads_tensor):
    """The backward differentiates only the elementwise part of a tile: a modifier that drops
    the score leaves q and k with exactly zero gradient (reached through v only for none)."""
    monkeypatch.setattr(tiles, "BLOCK_Q", 4)
    monkeypatch.setattr(tiles, "BLOCK_K", 8)
    weight = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=reads_tensor)

    def distance_only(score, b, h, q_idx, kv_idx):
        return -weight[h] * (q_idx - kv_idx).abs()

    q, k, v = rand_qkv(1, 2, 1, 9, 13, 4, 3, requires_grad=True)
    grads = {}
    for backend in ("fused", "reference"):
        out = qkv.attention(q, k, v, similarity=similarity, score_mod=distance_only,
                            mask=qkv.causal(), backend=backend)
        wanted = (q, k, v, weight) if reads_tensor else (q, k, v)
        found = torch.autograd.grad((out * out).sum(), wanted, allow_unused=True)
        pairs = zip(wanted, found, strict=True)
        grads[backend] = [torch.zeros_like(t) if g is None else g for t, g in pairs]
    assert (grads["fused"][0] == 0).all() and (grads["fused"][1] == 0).all()
    for g, r in zip(grads["fused"], grads["reference"], strict=True):
        assert rel_err(g, r) < 1e-10


def test_rows_without_keys_are_zero_with_zero_gradients():
    q, k, v = rand_qkv(2, 2, 2, 6, 6, 4, 4, requires_grad=True)
    out = qkv.attention(q, k, v, mask=qkv.padding([6, 0]), similarity="l2", backend="fused")
    assert (out[1] == 0).all()
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[1] == 0).all() and (k.grad[1] == 0).all() and (v.grad[1] == 0).all()


def _engine(**kwargs):
    q, k, v = rand_qkv(1, 2, 2, 8, 8, 4, 4)
    args = {"mask": None, "score_mod": None, "similarity": "dot", "scale": None, "metric": None,
            "dropout_p": 0.0, "return_weights": False, **kwargs}
    return plan(build_problem(q, k, v, **args)).engine


def test_dispatch_sends_plain_and_causal_dot_to_sdpa_and_the_rest_to_fused():
    assert _engine() == "sdpa"
    assert _engine(mask=qkv.causal()) == "sdpa"
    assert _engine(mask=qkv.sliding_window(2)) == "fused"
    assert _engine(score_mod=qkv.softcap(5.0)) == "fused"
    assert _engine(similarity="l1") == "fused"
    assert _engine(similarity="cosine") == "fused"  # SDPA takes cosine on CUDA only
    assert _engine(return_weights=True) == "fused"


def test_forced_backends():
    q, k, v = rand_qkv(1, 2, 2, 8, 8, 4, 4, requires_grad=True)
    fused = qkv.attention(q, k, v, backend="fused")
    ref = qkv.attention(q, k, v, backend="reference")
    assert rel_err(fused, ref) < 1e-12
    with pytest.raises(ValueError, match="backend='fused' cannot run this request"):
        qkv.attention(q, k, v, return_weights=True, backend="fused")


def test_inference_runs_the_same_kernels_without_a_graph():
    # Under no_grad the engines' kernels run directly (no autograd Function, no pytree of the
    # variant): the same bits as in grad mode, with a learnable slope and a graph mask.
    q, k, v = rand_qkv(2, 4, 2, 13, 17, 8, 8, requires_grad=True)
    slopes = torch.linspace(0.1, 0.8, 4, dtype=q.dtype).requires_grad_()
    kwargs = dict(mask=qkv.causal() & qkv.padding([17, 9]), score_mod=qkv.alibi(slopes=slopes),
                  similarity="l1", backend="fused")
    with_graph = qkv.attention(q, k, v, **kwargs)
    with torch.no_grad():
        inference = qkv.attention(q, k, v, **kwargs)
    assert with_graph.grad_fn is not None and inference.grad_fn is None
    assert torch.equal(inference, with_graph)


def test_returned_weights_come_from_the_saved_log_sum_exp():
    q, k, v = rand_qkv(2, 4, 2, 9, 11, 4, 3)
    mask = qkv.causal() & qkv.padding([11, 5])
    out, w = qkv.attention(q, k, v, mask=mask, similarity="cosine", return_weights=True)
    ref_out, ref_w = qkv.attention(
        q, k, v, mask=mask, similarity="cosine", return_weights=True, backend="reference"
    )
    assert rel_err(out, ref_out) < 1e-12 and rel_err(w, ref_w) < 1e-12


def _dropout_call(q, k, v, seed=7, **kwargs):
    torch.manual_seed(seed)
    return qkv.attention(q, k, v, mask=qkv.causal(), score_mod=qkv.softcap(4.0), dropout_p=0.3,
                         backend="fused", **kwargs)


def test_dropout_is_reproducible_and_matches_its_own_weights():
    q, k, v = rand_qkv(1, 2, 2, 13, 13, 4, 3)
    with torch.no_grad():
        out, w = _dropout_call(q, k, v, return_weights=True)
        again = _dropout_call(q, k, v)
        other = _dropout_call(q, k, v, seed=8)
    assert torch.equal(out, again) and not torch.equal(out, other)
    assert rel_err(out, w @ v) < 1e-12
    kept = (w > 0).sum() / torch.ones(13, 13).tril().sum() / 2
    assert 0.5 < float(kept) < 0.9  # about 1 - p of the allowed weights survive


def test_dropout_gradients_match_finite_differences():
    q, k, v = rand_qkv(1, 2, 1, 6, 6, 3, 2, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *t: _dropout_call(*t), (q, k, v))


def test_gather_path_dropout_gradients_match_finite_differences(monkeypatch):
    from qkv.engines.cpu import graph_gather

    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    monkeypatch.setattr(graph_gather, "_CHUNK_EDGES", 5)
    edges = torch.tensor([[0, 2, 1, 3, 0, 4, 5, 1, 2, 3], [0, 0, 1, 1, 2, 3, 4, 5, 5, 5]])
    mask = qkv.graph(edges, num_nodes=6)
    q, k, v = rand_qkv(1, 4, 2, 6, 6, 3, 2, requires_grad=True)

    def call(*t):
        torch.manual_seed(3)
        return qkv.attention(*t, mask=mask, score_mod=qkv.softcap(4.0), dropout_p=0.3,
                             backend="fused")

    assert torch.autograd.gradcheck(call, (q, k, v))


def test_several_workers_agree_with_the_reference_along_graph_chunks(monkeypatch):
    """The graph engine's chunks split across two workers: forward from the shared queue,
    backward by edges per worker."""
    torch.set_num_threads(2)
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    monkeypatch.setattr(graph_gather, "_CHUNK_EDGES", 16)
    q, k, v = rand_qkv(2, 4, 2, 29, 31, 8, 3, requires_grad=True)
    mask = qkv.graph(torch.rand(29, 31, generator=torch.Generator().manual_seed(4)) > 0.6)
    out = qkv.attention(q, k, v, mask=mask, backend="graph")
    ref = qkv.attention(q, k, v, mask=mask, backend="reference")
    grads = torch.autograd.grad((out * ref.detach()).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref.detach()).sum(), (q, k, v))
    assert rel_err(out, ref) < 1e-12
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-10


def test_several_workers_agree_with_the_reference(monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setattr(tiles, "BLOCK_Q", 4)
    q, k, v = rand_qkv(2, 4, 2, 19, 23, 4, 3, requires_grad=True)
    table = torch.randn(8, 4, dtype=torch.float64, requires_grad=True)
    kwargs = {"mask": qkv.causal(), "score_mod": qkv.relative_bias(table, 8, 16)}
    out = qkv.attention(q, k, v, backend="fused", **kwargs)
    ref = qkv.attention(q, k, v, backend="reference", **kwargs)
    grads = torch.autograd.grad((out * ref.detach()).sum(), (q, k, v, table))
    ref_grads = torch.autograd.grad((ref * ref.detach()).sum(), (q, k, v, table))
    assert rel_err(out, ref) < 1e-12
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-10


@pytest.mark.parametrize("n_workers", [1, 2, 3, 5])
@pytest.mark.parametrize("counts", [[16] * 16, list(range(1, 17)), [0, 3, 0, 7, 1, 1, 9, 2, 0]])
def test_workers_get_near_equal_work(n_workers, counts):
    """Every non-empty query block goes to exactly one worker, in ascending order; the keys
    they visit differ by at most one block's, and a causal plan's split evenly across two."""
    plan = [[(0, 1, False)] * c for c in counts]
    parts = workers.split_blocks(plan, n_workers, len)
    assert len(parts) == n_workers and all(part == sorted(part) for part in parts)
    assert sorted(i for part in parts for i in part) == [i for i, c in enumerate(counts) if c]
    loads = [sum(counts[i] for i in part) for part in parts]
    assert max(loads) - min(loads) <= max(counts)
    if counts == list(range(1, 17)) and n_workers == 2:
        assert loads == [68, 68]
    assert workers.split_blocks(plan, n_workers, len) == parts  # the same split every call


def test_causal_split_weighs_spans_by_their_keys():
    """A causal plan at N = 4096: 32 query blocks of 128, spans of up to 512 keys. Dealt in
    turn, both workers get 72 spans, but 32,768 and 34,816 keys; by keys, 33,792 each."""
    block_q, block_k, span_k = block_sizes(1, 8, 4096, 4096)
    spec = spec_for(qkv.causal(), 4096, 4096, block_q, block_k, heads=8)
    spec.span_k = span_k
    plan = tile_plan(spec, torch.device("cpu"))
    keys = [sum(k1 - k0 for k0, k1, _ in spans) for spans in plan]
    assert keys == [128 * (i + 1) for i in range(32)]
    parts = workers.split_blocks(plan, 2, tiles.keys_visited)
    assert [sum(keys[i] for i in part) for part in parts] == [33792, 33792]


def test_run_queued_runs_every_block_once():
    """One shared queue: each non-empty block runs once, on some worker."""
    plan = [[(0, 1, False)] * c for c in [2, 0, 5, 1, 1, 3, 0, 4]]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ran = workers.run_queued(lambda blocks: list(blocks), plan, len)
    finally:
        torch.set_num_threads(threads)
    assert len(ran) == 2
    assert sorted(i for part in ran for i in part) == [0, 2, 3, 4, 5, 7]


@pytest.mark.parametrize("team", [True, False])
def test_workers_run_each_job_on_its_own_thread_and_raise_on_the_caller_s(monkeypatch, team):
    """On torch's OpenMP team (where the C runner builds) or the thread pool: job(arg) for
    each arg, results in order, two workers on two threads, each single-threaded; a worker's
    exception reaches the caller, and torch's thread count comes back either way."""
    if not team:
        monkeypatch.setattr(workers, "_team", lambda: None)
    elif workers._team() is None:
        pytest.skip("no C compiler: the thread pool serves")
    threads = torch.get_num_threads()
    barrier = threading.Barrier(2, timeout=10)  # both jobs must run at once

    def job(arg):
        barrier.wait()
        modes = (torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"))
        return arg, threading.get_ident(), torch.get_num_threads(), modes

    # The caller's thread-local modes do not reach the jobs (one runs on the caller's thread).
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = workers._on_workers(2, job, ["a", "b"])
    assert [arg for arg, *_ in got] == ["a", "b"]
    assert got[0][1] != got[1][1] and {n for _, _, n, _ in got} == {1}
    assert {modes for *_, modes in got} == {(True, False)}
    assert torch.get_num_threads() == threads

    def failing(arg):
        if arg == "b":
            raise KeyError("from a worker")
        return arg

    with pytest.raises(KeyError, match="from a worker"):
        workers._on_workers(2, failing, ["a", "b"])
    assert torch.get_num_threads() == threads


def _chain_run(plan, slow_worker: str | None, chain_bytes: int = 1):
    """run_in_chains on two workers, each step appending (index, worker) to its chain's
    list; the worker named ``slow_worker`` (by its first item) sleeps in each step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    first: dict[int, str] = {}

    def step(i, ran, worker):
        first.setdefault(worker, "slow" if not first else "fast")
        if first[worker] == slow_worker:
            time.sleep(0.02)
        ran.append((i, worker))

    try:
        return workers.run_in_chains(step, plan, len, start_chain=list,
                                     start_worker=lambda: threading.get_ident(),
                                     chain_bytes=chain_bytes)
    finally:
        torch.set_num_threads(threads)


def test_chains_run_each_item_once_in_order_and_let_the_faster_worker_take_more():
    """Three chains for two workers: each non-empty block runs once, each chain's blocks in
    ascending order on whichever worker, the chains the same (fixed by the plan) whatever the
    workers' speeds; with one worker sleeping in every step, the other runs most blocks."""
    plan = [[(0, 1, False)] * c for c in [2, 0, 5, 1, 1, 3, 0, 4, 2, 2, 1, 3, 2, 1]]
    even = _chain_run(plan, None)
    uneven = _chain_run(plan, "slow")
    assert len(even) == 3 == workers.chain_count(2, 12, 1)
    for chains in (even, uneven):
        indices = [[i for i, _ in chain] for chain in chains]
        assert all(chain == sorted(chain) for chain in indices)
        assert sorted(i for chain in indices for i in chain) == [
            i for i, c in enumerate(plan) if c]
        assert indices == workers.split_blocks(plan, 3, len)
    by_worker: dict[int, int] = {}
    for _, worker in (step for chain in uneven for step in chain):
        by_worker[worker] = by_worker.get(worker, 0) + 1
    assert max(by_worker.values()) >= 8  # of 12; a fixed split gives each worker 6


def test_chains_of_a_plan_with_nothing_to_run_are_zeros():
    """A fully masked call visits no block: one chain, its sums made all the same (zeros)."""
    def step(*_):
        raise AssertionError("no block to run")

    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            sums = workers.run_in_chains(step, [[], []], len, start_chain=lambda: ["zeros"],
                                         start_worker=lambda: None, chain_bytes=1)
        finally:
            torch.set_num_threads(before)
        assert sums == [["zeros"]]


def test_chain_count_keeps_the_sums_within_the_budget():
    budget = workers.CHAIN_BUDGET_BYTES
    assert workers.chain_count(2, 100, 16 << 20) == 3  # N=4096: 16 MiB a chain
    assert workers.chain_count(4, 100, budget // 5) == 5
    assert workers.chain_count(2, 100, budget // 2) == 2  # never fewer than the workers
    assert workers.chain_count(3, 2, 1) == 2  # nor more than the items
    assert workers.chain_count(1, 100, 1) == 1
    assert workers.chain_count(2, 0, 1) == 1


def test_the_backward_sums_the_same_bits_whichever_worker_is_slow(monkeypatch):
    """The key-side sums go by chain, not by worker: a worker slowed in every block (so it
    runs fewer of them) leaves every gradient bit for bit the same: the fused engine's C
    blocks and tiles (learnable slopes keep the tiles), and the graph engine."""
    monkeypatch.setattr(tiles, "BLOCK_Q", 4)
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0)
    monkeypatch.setattr(graph_gather, "_CHUNK_EDGES", 16)
    q, k, v = rand_qkv(1, 4, 2, 37, 37, 8, 8, requires_grad=True, dtype=torch.float32)
    graph = qkv.graph(torch.rand(37, 37, generator=torch.Generator().manual_seed(4)) > 0.6)
    calls: list[int] = []  # the thread of each slowed call; the first one's thread sleeps

    def slowed(real):
        def run(*args):
            calls.append(threading.get_ident())
            if calls[-1] == calls[0]:
                time.sleep(0.01)
            return real(*args)
        return run

    slopes = torch.linspace(0.1, 0.5, 4).requires_grad_()
    cases = (("fused", {"mask": qkv.causal(), "score_mod": qkv.alibi(4)}),
             ("fused", {"mask": qkv.causal(), "score_mod": qkv.alibi(slopes=slopes)}),
             ("graph", {"mask": graph}))
    steps = ((fused_backward, "_backward_block"), (graph_gather, "_backward_chunk"),
             (native_blocks.Blocks, "run"))
    real = {name: getattr(module, name) for module, name in steps}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for backend, kwargs in cases:
            results = []
            for patch in (False, True):
                calls.clear()
                for module, name in steps:
                    monkeypatch.setattr(module, name,
                                        slowed(real[name]) if patch else real[name])
                out = qkv.attention(q, k, v, backend=backend, **kwargs)
                results.append(torch.autograd.grad(out.square().sum(), (q, k, v)))
            assert all(torch.equal(a, b) for a, b in zip(*results, strict=True)), backend
            assert len(set(calls)) == 2  # both workers ran steps of the slowed path
    finally:
        torch.set_num_threads(threads)


def test_block_sizes_shrink_for_many_heads():
    bq, bk, span = block_sizes(64, 32, 4096, 4096)
    assert 64 * 32 * bq * span <= tiles.MAX_TILE_ELEMENTS
    assert bk <= span
    assert block_sizes(1, 1, 5, 3) == (5, 3, 3)


# Runs in a child process: forcing large allocations onto mmap (so freed tensors leave the
# resident set) changes malloc for the whole process, which the rest of the suite should not see.
_MEMORY_PROBE = """
import ctypes, json, torch, qkv
torch.set_num_threads(1)
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: big blocks are mmapped and unmapped on free

def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

def peak(backend, n):
    q, k, v = (torch.randn(1, 2, n, 64, requires_grad=True) for _ in range(3))
    kwargs = {"mask": qkv.causal(), "score_mod": qkv.softcap(5.0), "backend": backend}
    qkv.attention(q, k, v, **kwargs).sum().backward()  # warm-up: lazy inits stay out
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:  # reset the kernel's high-water mark
        f.write("5")
    before = status("VmRSS")
    qkv.attention(q, k, v, **kwargs).sum().backward()
    return status("VmHWM") - before

print(json.dumps({"fused": [peak("fused", 2048), peak("fused", 4096)],
                  "reference": [peak("reference", 1024), peak("reference", 2048)]}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_memory_grows_linearly_with_n():
    """Forward+backward peak memory: ~2x from N to 2N for the fused engine, ~4x for the
    materializing reference (the control that shows the measurement can see O(N²))."""
    run = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE], capture_output=True, text=True, timeout=300
    )
    if run.returncode != 0 and "clear_refs" in run.stderr:
        pytest.skip("cannot reset the peak-memory mark (/proc/self/clear_refs)")
    assert run.returncode == 0, run.stderr
    peaks = json.loads(run.stdout.strip().splitlines()[-1])
    fused, reference = peaks["fused"], peaks["reference"]
    assert reference[1] / reference[0] > 3.0
    assert fused[1] / fused[0] < 2.5
    assert fused[1] < reference[0]


@pytest.mark.parametrize("similarity", ["dot", "l2", "l1"])
def test_projection_layout_inputs(similarity):
    """q, k, v as attention layers make them, (B, N, H, D) transposed to (B, H, N, D): not
    contiguous, batch > 1, grouped heads; the gradient buffers must not inherit the layout."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 37, h, 8, generator=g, dtype=torch.float64).transpose(1, 2)
               .requires_grad_() for h in (4, 2, 2))
    kw = {"similarity": similarity, "mask": qkv.causal(), "score_mod": qkv.alibi(4)}
    out = qkv.attention(q, k, v, backend="fused", **kw)
    ref = qkv.attention(q, k, v, backend="reference", **kw)
    grad = torch.randn(2, 37, 4, 8, generator=g, dtype=torch.float64).transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad)
    assert rel_err(out, ref) < 1e-12
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel_err(got, want) < 1e-10
