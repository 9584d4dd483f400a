"""Without the C library: the engines run the same algorithm on torch operations, and a
build that fails, a missing compiler or QKV_NATIVE=0 warns once and falls back. The library
is built once per cache directory. These run whether or not this machine has a C compiler."""

import json
import os
import subprocess
import sys

import pytest
import torch

import qkv
from qkv.engines.cpu import native

_PROBE = """
import warnings, torch, qkv
from qkv.engines.cpu import native
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
    ok, warned, err = _probe(tmp_path, CC=str(tmp_path / "no-such-compiler"), QKV_NATIVE="1")
    assert not ok and warned and err < 1e-12
    assert not list(tmp_path.glob("*.so"))
    ok, warned, err = _probe(tmp_path, QKV_NATIVE="0")
    assert not ok and not warned and err < 1e-12


# Every engine a CPU call can reach, with the C kernels' users (the fused engine's tiles and
# blocks, generated terms and modifiers, the graph engine's edges, the flash engine): the
# reference's results, and one warning in all.
_WITHOUT = """
import json, warnings, torch, qkv
from qkv import engines
from qkv.core.problem import build_problem
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    g = torch.Generator().manual_seed(4)
    n = 130
    edges = torch.randint(0, n, (2, 3 * n), generator=g)
    user = qkv.Similarity(lambda q, k: -(q - k).abs() * 0.7)
    used = []
    for dtype, similarity, mask, mod in [
            (torch.float32, "dot", qkv.causal(), None), (torch.float64, "l1", qkv.causal(), None),
            (torch.float64, user, None, qkv.softcap(4.0)),
            (torch.float64, "l2", qkv.graph(edges, num_nodes=n), None)]:
        q, k, v = (torch.randn(1, 2, n, 16, generator=g, dtype=dtype) for _ in range(3))
        kw = {"similarity": similarity, "mask": mask, "score_mod": mod}
        with torch.no_grad():
            used.append(engines.plan(build_problem(q, k, v, **kw)).engine)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        outs = [qkv.attention(q, k, v, backend=b, **kw) for b in ("auto", "reference")]
        grads = [torch.autograd.grad(out.square().sum(), (q, k, v)) for out in outs]
        tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
        torch.testing.assert_close(outs[0], outs[1], **tol)
        for a, b in zip(*grads):
            torch.testing.assert_close(a, b, **tol)
print(json.dumps({"engines": used, "warnings": [str(w.message) for w in seen]}))
"""


@pytest.mark.parametrize("how,reason", [
    ({"QKV_NATIVE": "0"}, "QKV_NATIVE=0"),
    ({"PATH": "", "QKV_NATIVE": "1"}, "no C compiler (set CC, or install cc or gcc)"),
])
def test_without_c_every_engine_runs_on_torch_with_one_warning(tmp_path, how, reason):
    env = {**os.environ, "QKV_CACHE": str(tmp_path), **how}
    env.pop("CC", None)
    done = subprocess.run([sys.executable, "-c", _WITHOUT], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    found = json.loads(done.stdout)
    assert found["engines"] == ["sdpa", "fused", "fused", "graph"]
    assert found["warnings"] == [f"qkv: {reason}; the CPU engines use torch operations (the "
                                 "same results, slower)"]
    assert not list(tmp_path.glob("*.so"))


@pytest.mark.parametrize("similarity", ["dot", "l2", "l1", "laplacian", "p3"])
@pytest.mark.parametrize("gather", [False, True])
def test_torch_fallback_without_the_c_library(monkeypatch, similarity, gather):
    """What a machine without a compiler runs: the same engine on torch operations."""
    from qkv.engines.cpu import graph_gather, tiles

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
