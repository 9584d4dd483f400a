"""The C kernels built for other targets and by other compilers than this machine's default
(docs/portability.md): each x86-64 level (QKV_MARCH), clang, a compiler without OpenMP (as
Apple's clang), one that does not know -march=native. Each build runs in a fresh process
against the float64 reference."""

import json
import os
import platform
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from qkv.engines.cpu import build, native

pytestmark = [
    pytest.mark.slow,  # a process and a build per case, about 10 s each
    pytest.mark.skipif(not native.available(torch.float32), reason="no C compiler"),
]
X86 = platform.machine() in ("x86_64", "AMD64")

# Fused (tiles, C blocks and C workers) and graph engines, forward and backward, with the
# built-in terms, a generated one (a user's similarity) and a generated score modifier, in
# float64 against the reference; the L1 tile loops in float32 against torch.cdist.
_PROBE = """
import json, warnings, torch, qkv
from qkv.engines.cpu import cpu_flash, native, workers
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as seen:
    ok = native.available(torch.float32)
torch.set_num_threads(2)
g = torch.Generator().manual_seed(3)
n = 150
edges = torch.randint(0, n, (2, 4 * n), generator=g)
user = qkv.Similarity(lambda q, k: -(q - k).abs() * 0.7 + 0.1 * q * k)
for similarity, mask, mod in [("dot", qkv.causal(), None), ("l2", qkv.sliding_window(40), None),
                              ("l1", qkv.causal(), qkv.alibi(4)), (user, None, qkv.softcap(5.0)),
                              ("l1", qkv.graph(edges, num_nodes=n), None)]:
    q, k, v = (torch.randn(2, 4, n, 24, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    kw = {"similarity": similarity, "mask": mask, "score_mod": mod}
    got = [qkv.attention(q, k, v, backend=b, **kw) for b in ("auto", "reference")]
    grads = [torch.autograd.grad((out * out).sum(), (q, k, v)) for out in got]
    torch.testing.assert_close(got[0], got[1], rtol=1e-10, atol=1e-12)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
q, k = torch.randn(2, 3, 37, 40, generator=g), torch.randn(2, 3, 70, 40, generator=g)
want = -torch.cdist(q.double(), k.double(), p=1)
torch.testing.assert_close(native.l1_scores(q, k).double(), want, rtol=1e-5, atol=1e-4)
flash = cpu_flash._library("fp32")
print(json.dumps({"available": ok, "vector_bytes": native._load()["vector_bytes"],
                  "team": workers._team() is not None, "warnings": [str(w.message) for w in seen],
                  "flash": flash if isinstance(flash, str) else "built"}))
"""


def _probe(tmp_path, **env) -> dict:
    # QKV_FLASH=1: the flash engine builds on any vendor's CPU, so its build is checked on
    # Intel's too (where it is off by default until measured).
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env={**os.environ, "QKV_CACHE": str(tmp_path / "cache"),
                               "QKV_FLASH": "1", **env},
                          timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout)


@pytest.mark.skipif(not X86, reason="x86-64 levels")
@pytest.mark.parametrize("level,vector_bytes", [("x86-64-v2", 16), ("x86-64-v3", 32),
                                                ("x86-64-v4", 64)])
def test_each_x86_level_builds_and_matches_float64(tmp_path, level, vector_bytes):
    """v2 has no AVX (16-byte vectors), v3 AVX2 (32), v4 AVX-512 (64); the flash engine
    needs AVX-512 and says so on the others."""
    if build.missing_features(level):
        pytest.skip(f"this CPU does not run {level}")
    found = _probe(tmp_path, QKV_MARCH=level)
    assert found["available"] and not found["warnings"] and found["team"]
    assert found["vector_bytes"] == vector_bytes
    assert (found["flash"] == "built") == (level == "x86-64-v4"), found["flash"]
    # one build per target: the level names the library, not this CPU's flags
    assert len(list((tmp_path / "cache").glob("cpu_kernels_*.so"))) == 1


def test_clang_builds_them(tmp_path):
    if shutil.which("clang") is None:
        if os.environ.get("CI"):
            raise RuntimeError("clang is missing; .ci/run installs it")
        pytest.skip("clang is not installed (apt-get install clang)")
    found = _probe(tmp_path, CC="clang")
    assert found["available"] and not found["warnings"]


def _refusing(tmp_path, flag: str) -> str:
    """A compiler command that fails on ``flag`` and is this machine's otherwise."""
    wrapper = tmp_path / f"cc-without{flag}"
    compiler = " ".join(build.compiler())
    wrapper.write_text(f'#!/bin/sh\nfor a in "$@"; do [ "$a" = "{flag}" ] && '
                       f'{{ echo "unsupported option {flag}" >&2; exit 1; }}; done\n'
                       f'exec {compiler} "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def test_without_openmp_the_workers_use_a_thread_pool(tmp_path):
    """As with Apple's clang: the team runner and the flash engine need -fopenmp; the tile
    kernels build without it and the workers run on a thread pool, with the same results."""
    found = _probe(tmp_path, CC=_refusing(tmp_path, "-fopenmp"))
    assert found["available"] and not found["warnings"] and not found["team"]
    assert found["flash"] == "cpu_flash.c did not build (it needs a compiler with -fopenmp)"


def test_a_compiler_without_march_native_builds_for_its_default(tmp_path):
    found = _probe(tmp_path, CC=_refusing(tmp_path, "-march=native"))
    assert found["available"] and not found["warnings"] and found["team"]


def test_a_level_this_cpu_lacks_is_refused_with_one_warning(monkeypatch):
    """Code for a higher level would stop at its first unknown instruction: the kernels stay
    off instead, and say which features are missing."""
    monkeypatch.setattr(build, "cpuinfo_line", lambda key: "flags\t\t: avx avx2 avx512f")
    assert build.missing_features("x86-64-v4")[:3] == ["cx16", "lahf_lm", "popcnt"]
    assert "avx512bw" in build.missing_features("x86-64-v4")
    assert build.missing_features("native") == build.missing_features("armv8-a") == []
    monkeypatch.setenv("QKV_MARCH", "x86-64-v4")
    monkeypatch.setattr(native, "_functions", None)
    monkeypatch.setattr(native, "_tried", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not native.available(torch.float32) and not native.available(torch.float64)
    assert len(seen) == 1
    assert "QKV_MARCH=x86-64-v4 needs CPU features this CPU lacks (cx16" in str(seen[0].message)
