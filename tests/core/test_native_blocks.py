"""The fused engine's query blocks in C (``native_blocks``, ``cpu_blocks.c``): which calls they
run, and that they agree with the tile path and the float64 reference on every layout."""

import pytest
import torch

import qkv
from qkv.core.problem import build_problem
from qkv.engines.cpu import native, native_blocks, paths
from qkv.engines.cpu.fused_cpu import _spec
from qkv.engines.lowering import Lowered

from .conftest import rand_qkv, rel_err

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not native.available(torch.float32), reason="needs a C compiler"),
]


@pytest.fixture
def block_runs(monkeypatch):
    """The number of query blocks the C blocks ran, forward and backward."""
    runs = []
    real = native_blocks.Blocks.run

    def counted(self, *args):
        runs.append(self.call.out is not None)
        return real(self, *args)

    monkeypatch.setattr(native_blocks.Blocks, "run", counted)
    return runs


def _tile_path(monkeypatch):
    monkeypatch.setattr(paths, "PATHS", paths.PATHS[1:])  # the tiles, not the C blocks


def _out_and_grads(q, k, v, backend="fused", **kwargs):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out, lse = qkv.attention(*leaves, backend=backend, return_lse=True, **kwargs)
    g = torch.Generator().manual_seed(7)
    # A gradient on lse as well as on out: both reach the blocks' delta.
    loss = (out * torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)).sum()
    loss = loss + (lse.masked_fill(lse.isinf(), 0) * 0.3).sum()
    return [out, *torch.autograd.grad(loss, leaves)]


CASES = {
    "plain": dict(shape=(1, 4, 4, 70, 70, 16, 16), kwargs={}),
    "causal, grouped heads, Nq < Nk, D != Dv": dict(shape=(2, 6, 3, 37, 50, 40, 24),
                                                    kwargs={"mask": qkv.causal()}),
    "causal, Nq > Nk (rows without keys)": dict(shape=(1, 4, 2, 60, 23, 8, 8),
                                                kwargs={"mask": qkv.causal()}),
    "padding per batch item": dict(shape=(2, 2, 2, 33, 41, 8, 8),
                                   kwargs={"mask": qkv.padding([41, 9])}),
    "window": dict(shape=(1, 2, 1, 90, 90, 8, 8), kwargs={"mask": qkv.sliding_window(7)}),
    "cosine": dict(shape=(1, 2, 2, 30, 30, 8, 8), kwargs={"similarity": "cosine"}),
    "scale": dict(shape=(1, 2, 2, 30, 30, 8, 8), kwargs={"scale": 0.7}),
    # L1's own gradient loops take whole vectors of d: 16 is a multiple of AVX2's 8 lanes
    # and AVX-512's 16.
    "l1, causal, grouped heads": dict(shape=(2, 4, 2, 40, 47, 16, 8),
                                      kwargs={"mask": qkv.causal(), "similarity": "l1"}),
    "l1, negative scale": dict(shape=(1, 2, 2, 30, 30, 16, 8),
                               kwargs={"similarity": "l1", "scale": -0.2}),
    "l1, negative scale, softcap": dict(shape=(1, 2, 2, 30, 30, 16, 8), kwargs={
        "similarity": "l1", "scale": -0.2, "score_mod": qkv.softcap(4.0)}),
    "user l1, window": dict(shape=(1, 2, 1, 50, 50, 8, 8), kwargs={
        "similarity": qkv.Similarity(lambda q, k: -(q - k).abs()),
        "mask": qkv.sliding_window(11)}),
    "user term, odd head dim, scale": dict(shape=(1, 2, 2, 30, 30, 5, 3), kwargs={
        "similarity": qkv.Similarity(lambda q, k: -(q - k).abs() ** 3), "scale": 0.3}),
    "l2, causal, grouped heads": dict(shape=(2, 4, 2, 40, 47, 8, 8),
                                      kwargs={"mask": qkv.causal(), "similarity": "l2"}),
    # A scale <= 0 is not folded into L2's features: the blocks clamp, then scale.
    "l2, negative scale": dict(shape=(1, 2, 2, 30, 30, 8, 8),
                               kwargs={"similarity": "l2", "scale": -0.4}),
    "mahalanobis, a metric per head": dict(shape=(1, 2, 2, 33, 33, 8, 8), kwargs={
        "similarity": "mahalanobis",
        "metric": torch.eye(8, dtype=torch.float64) + 0.2 * torch.randn(
            2, 8, 8, generator=torch.Generator().manual_seed(5), dtype=torch.float64)}),
    # Modifiers: the slope 1 (ALiBi, a bias) and one the backward keeps (softcap).
    "alibi, causal, grouped heads": dict(shape=(2, 4, 2, 40, 40, 8, 8),
                                         kwargs={"mask": qkv.causal(), "score_mod": qkv.alibi(4)}),
    "softcap, scale": dict(shape=(1, 3, 3, 45, 52, 8, 8),
                           kwargs={"score_mod": qkv.softcap(2.0), "scale": 1.5}),
    "softcap after a bias, window": dict(shape=(1, 2, 1, 50, 50, 8, 8), kwargs={
        "mask": qkv.sliding_window(9),
        "score_mod": [lambda s, b, h, qi, ki: s - 0.25 * h * (qi - ki), qkv.softcap(3.0)]}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blocks_agree_with_the_reference_and_the_tiles(case, dtype, block_runs, monkeypatch):
    monkeypatch.setattr("qkv.engines.cpu.tiles.BLOCK_Q", 16)  # several blocks and spans
    monkeypatch.setattr("qkv.engines.cpu.tiles.DENSE", 16)
    shape, kwargs = CASES[case]["shape"], CASES[case]["kwargs"]
    q, k, v = rand_qkv(*shape, dtype=torch.float64, seed=3)
    ref = _out_and_grads(q, k, v, backend="reference", **kwargs)
    ours = _out_and_grads(*(t.to(dtype) for t in (q, k, v)), **kwargs)
    assert any(block_runs) and not all(block_runs)  # forward and backward ran in C
    tol = (1e-5, 1e-4) if dtype == torch.float32 else (1e-12, 1e-11)
    assert rel_err(ours[0], ref[0]) < tol[0]
    for a, b in zip(ours[1:], ref[1:], strict=True):
        assert rel_err(a, b) < tol[1]
    _tile_path(monkeypatch)
    block_runs.clear()
    tiles = _out_and_grads(*(t.to(dtype) for t in (q, k, v)), **kwargs)
    assert not block_runs
    for a, b in zip(ours, tiles, strict=True):
        assert rel_err(a, b) < tol[0]


def test_rows_without_keys_stay_zero():
    q, k, v = rand_qkv(1, 2, 2, 12, 5, 4, 4, dtype=torch.float32)
    out, dq, dk, dv = _out_and_grads(q, k, v, mask=qkv.causal())
    assert torch.equal(out[:, :, :7], torch.zeros_like(out[:, :, :7]))
    assert torch.equal(dq[:, :, :7], torch.zeros_like(dq[:, :, :7]))
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()


@pytest.mark.parametrize("similarity", ["dot", "l2", "l1"])
def test_inputs_in_projection_layout(similarity, block_runs):
    """(B, N, H, D) projections viewed as (B, H, N, D): rows H·D apart, heads D apart (read
    in place by the products, copied for a term's C loops, which read rows D apart)."""
    g = torch.Generator().manual_seed(1)
    # D=16: whole vectors for L1's loops on AVX2 (8 lanes) and AVX-512 (16).
    q, k, v = (torch.randn(2, 19, 3, 16, generator=g).transpose(1, 2) for _ in range(3))
    kwargs = {"mask": qkv.causal(), "similarity": similarity}
    ref = _out_and_grads(*(t.double() for t in (q, k, v)), backend="reference", **kwargs)
    ours = _out_and_grads(q, k, v, **kwargs)
    assert block_runs
    for a, b in zip(ours, ref, strict=True):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("kwargs, reason", [
    ({"similarity": "l1"}, "head dim"),
    ({"score_mod": qkv.alibi(slopes=torch.ones(2, requires_grad=True))}, "score modifier"),
    ({"dropout_p": 0.1}, "dropout"),
])
def test_what_the_blocks_do_not_run_goes_to_the_tiles(kwargs, reason, block_runs):
    q, k, v = rand_qkv(1, 2, 2, 20, 20, 6, 6, dtype=torch.float32, requires_grad=True)
    out = qkv.attention(q, k, v, backend="fused", **kwargs)
    out.sum().backward()
    assert not block_runs
    p = build_problem(q, k, v, **kwargs)
    spec = _spec(q, k, Lowered(p.similarity.pairwise, p.score_mod, p.mask, p.scale),
                 p.dropout_p, 0)
    assert reason in native_blocks.why_not(spec, q)


def test_why_not_names_extra_gradients_and_dtypes():
    from qkv.core.similarity import DOT
    from qkv.engines.cpu.tiles import TileSpec
    spec = TileSpec(Lowered(DOT, None, None, None), 1, 2, 10, 10, 0.0, 0, 16, 16)
    q = torch.zeros(1, 2, 10, 8)
    assert native_blocks.why_not(spec, q) is None
    learnable = torch.ones(2, requires_grad=True)
    assert "tensors besides" in native_blocks.why_not(spec, q, [learnable])
    assert "bfloat16" in native_blocks.why_not(spec, q.bfloat16())


def test_without_a_blas_to_call_the_tiles_run(monkeypatch, block_runs):
    """A torch whose library exports no sgemm_ (another BLAS, another platform)."""
    monkeypatch.setattr(native_blocks, "_gemm", lambda dtype: None)
    q, k, v = rand_qkv(1, 2, 2, 20, 20, 8, 8, dtype=torch.float64)
    ours = _out_and_grads(q, k, v, mask=qkv.causal())
    ref = _out_and_grads(q, k, v, backend="reference", mask=qkv.causal())
    assert not block_runs
    for a, b in zip(ours, ref, strict=True):
        assert rel_err(a, b) < 1e-11


def test_blocks_refuse_outputs_they_cannot_write_in_place():
    """out, lse and dq are written in place, so they are never copied into a layout."""
    q, k, v = rand_qkv(1, 2, 2, 16, 16, 8, 8, dtype=torch.float32)
    specs = {}
    for similarity in ("dot", "l1"):
        p = build_problem(q, k, v, similarity=similarity)
        specs[similarity] = _spec(q, k, Lowered(p.similarity.pairwise, None, None, p.scale),
                                  0.0, 0)
    lse = torch.zeros(1, 2, 16, 1)
    with pytest.raises(ValueError, match="lse"):
        native_blocks.Blocks(specs["dot"], q, k, v, out=torch.zeros(1, 2, 16, 8),
                             lse=torch.zeros(1, 16, 2, 1).transpose(1, 2))
    with pytest.raises(ValueError, match="out"):
        native_blocks.Blocks(specs["dot"], q, k, v, lse=lse,
                             out=torch.zeros(1, 2, 8, 16).transpose(-1, -2))
    rows_apart = torch.zeros(1, 16, 2, 8).transpose(1, 2)  # rows 16 apart: products only
    backward = {"lse": lse, "dout": torch.zeros(1, 2, 16, 8), "delta": lse, "dq": rows_apart}
    native_blocks.Blocks(specs["dot"], q, k, v, **backward)
    with pytest.raises(ValueError, match="dq"):
        native_blocks.Blocks(specs["l1"], q, k, v, **backward)
