"""Fresh processes, two at once on one empty kernel cache, so that they build every C library
at the same time, then one without the C kernels. Each first calls torch's unary functions
that MKL computes, on tensors large enough for two threads, then runs every CPU engine path
in float32, float64 and bf16, forward and backward. Each call runs twice and the two runs
match bit for bit; the float64 calls match the float64 reference; the two processes that
share a cache match each other bit for bit. A first call in a process is the one that can go
wrong (MKL choosing a kernel while two threads call it, ``qkv.threads.choose_vml_kernels``; a
C library loaded while another process writes it), so each fresh process counts."""

import json
import os
import subprocess
import sys

import pytest
import torch

from qkv.engines.cpu import native

needs_c = pytest.mark.skipif(not native.available(torch.float32), reason="no C compiler")
# torch's unary functions that ATen computes with MKL's vector math on contiguous float32 and
# float64 tensors (ATen's cpu/vml.h)
VML = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
       "sin", "sqrt", "tan", "tanh", "trunc")

_RUN = """
import hashlib, json, sys, torch
torch.set_num_threads(2)
import qkv
from qkv.engines.cpu import paths

ran = set()
choose = paths.choose


def recorded(spec, q, extras=()):
    path, refused = choose(spec, q, extras)
    ran.add(f"{path.name} {q.dtype}")
    return path, refused


paths.choose = recorded
digest = hashlib.sha256()


def same(a, b, what):
    assert torch.equal(a, b), f"{what}: the second run differs from the first"
    digest.update(a.detach().contiguous().view(torch.uint8).numpy().tobytes())


# MKL's vector functions (the arguments), first called on 2^17 elements: two threads' shares
g = torch.Generator().manual_seed(0)
x = torch.rand(1 << 17, generator=g, dtype=torch.float64) * 0.98 + 0.01
for name in sys.argv[1:]:
    for dtype in (torch.float32, torch.float64):
        t = x.to(dtype)
        same(getattr(torch, name)(t), getattr(torch, name)(t), f"{name} {dtype}")

n = 160
edges = torch.randint(0, n, (2, 4 * n), generator=g)
user = qkv.Similarity(lambda q, k: -(q - k).abs() * 0.7 + 0.1 * q * k)
CASES = {
    "dot causal": {"mask": qkv.causal()},
    "l2 window": {"similarity": "l2", "mask": qkv.sliding_window(40)},
    "l1 alibi": {"similarity": "l1", "mask": qkv.causal(), "score_mod": qkv.alibi(2)},
    "user softcap": {"similarity": user, "score_mod": qkv.softcap(5.0)},
    "l1 graph": {"similarity": "l1", "mask": qkv.graph(edges, num_nodes=n)},
    "learnt alibi": {"mask": qkv.causal(),
                     "score_mod": qkv.alibi(slopes=torch.tensor([0.5, 0.25],
                                                                requires_grad=True))},
}


def twice(q, k, v, name, kw, backend="auto"):
    mod = kw.get("score_mod")
    leaves = (q, k, v, *(t for t in (mod.tensors() if mod else ()) if t.requires_grad))
    runs = []
    for _ in range(2):
        out = qkv.attention(q, k, v, backend=backend, **kw)
        runs.append((out, *torch.autograd.grad((out.float() ** 2).sum(), leaves)))
    for i, (a, b) in enumerate(zip(*runs)):
        same(a, b, f"{name} {q.dtype} {backend} {'forward' if i == 0 else f'gradient {i}'}")
    return runs[0]


for name, kw in CASES.items():
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        q, k, v = (torch.randn(2, 2, n, 16, generator=g, dtype=torch.float64).to(dtype)
                   .requires_grad_() for _ in range(3))
        got = twice(q, k, v, name, kw)
        if dtype == torch.float64 and name != "user softcap":  # its reference takes seconds
            want = twice(q, k, v, name, kw, backend="reference")
            torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
            for a, b in zip(got[1:], want[1:]):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
with torch.no_grad():  # inference: the flash engine where this CPU has it, else SDPA
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(2, 2, 256, 64, generator=g).to(dtype) for _ in range(3))
        same(qkv.attention(q, k, v, mask=qkv.causal()),
             qkv.attention(q, k, v, mask=qkv.causal()), f"inference {dtype}")
print(json.dumps({"paths": sorted(ran), "digest": digest.hexdigest()}))
"""


def _processes(cache, *envs: dict) -> list[dict]:
    """One process per environment in ``envs``, all started at once on the empty kernel
    cache ``cache``."""
    started = [subprocess.Popen([sys.executable, "-c", _RUN, *VML], text=True,
                                env={**os.environ, "QKV_CACHE": str(cache), **env},
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
               for env in envs]
    found = []
    for process in started:
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-4000:]
        found.append(json.loads(out.splitlines()[-1]))
    return found


@pytest.mark.slow  # about 50 s on 2 cores: a pair of processes, then one without C
@needs_c
def test_fresh_processes_building_one_cache_compute_the_same_exact_results(tmp_path):
    first, second = _processes(tmp_path / "cache", {}, {})
    assert first["digest"] == second["digest"], "the two processes' results differ"
    for dtype in (torch.float32, torch.float64):
        assert {f"BLOCKS {dtype}", f"TILES {dtype}"} <= set(first["paths"]), first
    # each build was renamed into place: no partial file is left beside the libraries
    assert not [p.name for p in (tmp_path / "cache").glob("tmp*")]
    # without the C kernels, every fused call runs on torch operations
    (torch_only,) = _processes(tmp_path / "none", {"QKV_NATIVE": "0"})
    assert {path.split()[0] for path in torch_only["paths"]} == {"TORCH_TILES"}, torch_only


_IMPORT = """
import json, torch
from torch.overrides import TorchFunctionMode


class Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.single = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
            self.single.add(f"{func.__name__} {args[0].dtype}")
        return func(*args, **(kwargs or {}))


with Calls() as calls:
    import qkv
print(json.dumps(sorted(calls.single)))
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_import_has_mkl_choose_each_vector_kernel_on_one_thread():
    """Whatever the CPU: the race above needs a machine that shows it, this does not."""
    done = subprocess.run([sys.executable, "-c", _IMPORT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    single = set(json.loads(done.stdout))
    assert {f"{name} {dtype}" for name in VML for dtype in (torch.float32, torch.float64)} <= single
