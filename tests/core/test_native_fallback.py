"""Without the C library: the engine runs the same algorithm on torch operations, and a
build that fails warns once and falls back. The library is built once per cache directory.
These run whether or not this machine has a C compiler."""

import os
import subprocess
import sys

import pytest
import torch

import qkv
from qkv.core.engines import native

_PROBE = """
import warnings, torch, qkv
from qkv.core.engines import native
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    ok = native.available(torch.float32)
q, k, v = (torch.randn(1, 2, 20, 8, dtype=torch.float64) for _ in range(3))
out = qkv.attention(q, k, v, similarity="l1", backend="fused")
ref = qkv.attention(q, k, v, similarity="l1", backend="reference")
print(ok, any("did not build" in str(w.message) for w in seen), float((out - ref).abs().max()))
"""


def _probe(tmp_path, **env):
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env={**os.environ, "QKV_CACHE": str(tmp_path), **env}, check=True)
    ok, warned, err = done.stdout.split()
    return ok == "True", warned == "True", float(err)


@pytest.mark.skipif(not native.available(torch.float32), reason="no C compiler")
def test_built_once_per_cache_directory(tmp_path):
    assert _probe(tmp_path)[0]
    (built,) = tmp_path.glob("cpu_kernels_*.so")
    stamp = built.stat().st_mtime_ns
    ok, warned, err = _probe(tmp_path)
    assert ok and not warned and err < 1e-12
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no leftover partial file
    assert built.stat().st_mtime_ns == stamp


def test_without_a_compiler_the_engine_falls_back_to_cdist(tmp_path):
    ok, warned, err = _probe(tmp_path, CC=str(tmp_path / "no-such-compiler"))
    assert not ok and warned and err < 1e-12
    assert not list(tmp_path.glob("*.so"))
    ok, warned, err = _probe(tmp_path, QKV_NATIVE="0")
    assert not ok and not warned and err < 1e-12


@pytest.mark.parametrize("similarity", ["dot", "l2", "l1", "laplacian", "p3"])
@pytest.mark.parametrize("gather", [False, True])
def test_torch_fallback_without_the_c_library(monkeypatch, similarity, gather):
    """What a machine without a compiler runs: the same engine on torch operations."""
    from qkv.core.engines import graph_gather, tiles

    monkeypatch.setattr(native, "_functions", None)
    monkeypatch.setattr(native, "_tried", True)
    monkeypatch.setattr(tiles, "BLOCK_Q", 4)
    monkeypatch.setattr(tiles, "BLOCK_K", 8)
    monkeypatch.setattr(graph_gather, "_GATHER_COST", 0 if gather else 1 << 30)
    monkeypatch.setattr(graph_gather, "_CHUNK_EDGES", 12)
    assert not native.available(torch.float64)
    g = torch.Generator().manual_seed(9)
    n = 19
    edges = torch.randint(0, n, (2, 3 * n), generator=g)
    # On tiles, a graph combined with causal; the gather path takes the graph alone.
    mask = qkv.graph(edges, num_nodes=n) if gather else qkv.graph(edges, num_nodes=n) & qkv.causal()
    q, k, v = (torch.randn(2, 4 if i == 0 else 2, n, 5, generator=g, dtype=torch.float64,
                           requires_grad=True) for i in range(3))
    kw = {"similarity": similarity, "mask": mask, "score_mod": qkv.alibi(4)}
    out = qkv.attention(q, k, v, backend="graph" if gather else "fused", **kw)
    ref = qkv.attention(q, k, v, backend="reference", **kw)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad((out * ref.detach()).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * ref.detach()).sum(), (q, k, v))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
