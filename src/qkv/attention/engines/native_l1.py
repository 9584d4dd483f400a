"""The L1 kernel in C (``l1_kernel.c``) for the fused CPU engine's tiles, with its gradients.

-‖q-k‖₁ has no matrix-multiply form, so it is O(m·n·d) elementwise work either way; the C
loops vectorize across keys instead of across d (about 3x faster than ``torch.cdist``
forward, more backward; see docs/benchmarks.md). The source is compiled once per machine
with the system C compiler into ``$QKV_CACHE`` (default ``~/.cache/qkv``), which takes about
a second. Without a compiler, or with ``QKV_NATIVE=0``, ``available()`` is False and the
engine uses ``torch.cdist`` with autograd, the reference's own formula.

The C code is called through ctypes, which releases the GIL, so the engine's workers run it
in parallel.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = Path(__file__).with_name("l1_kernel.c")
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-math-errno", "-fPIC", "-shared"]
_BLOCK = 64  # BLOCK in l1_kernel.c: keys per transposed block
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("QKV_CACHE") or Path.home() / ".cache" / "qkv")


def _cpu_flags() -> str:
    """The CPU's feature flags: ``-march=native`` code is only valid on a CPU that has them."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join(
        [source, compiler.encode(), " ".join(_FLAGS).encode(), _cpu_flags().encode()]
    )).hexdigest()[:16]
    target = _cache_dir() / f"l1_kernel_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile beside the target and rename: another process never loads a half-written file.
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", partial], check=True,
                       capture_output=True, text=True, timeout=120)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    with _lock:
        if _tried:
            return _library
        _tried = True
        if os.environ.get("QKV_NATIVE", "1") == "0":
            return None
        compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            return None
        try:
            lib = ctypes.CDLL(str(_build(compiler)))
        except (OSError, subprocess.SubprocessError) as err:
            detail = getattr(err, "stderr", "") or err
            warnings.warn(f"qkv: the C L1 kernel did not build ({detail}); using torch.cdist",
                          RuntimeWarning, stacklevel=3)
            return None
        i64 = ctypes.c_int64
        for suffix in _SUFFIX.values():
            getattr(lib, f"l1_scores_{suffix}").argtypes = [ctypes.c_void_p] * 3 + [i64] * 4 + [
                ctypes.c_void_p]
            getattr(lib, f"l1_grads_{suffix}").argtypes = [ctypes.c_void_p] * 5 + [i64] * 4 + [
                ctypes.c_void_p] * 2
        _library = lib
        return lib


def available(dtype: torch.dtype) -> bool:
    """Whether the C kernel serves CPU tensors of ``dtype`` (it is built on first call)."""
    return dtype in _SUFFIX and _load() is not None


def _batched(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous()


def scores(q: Tensor, k: Tensor) -> Tensor:
    """-‖q-k‖₁ (..., m, n) for q (..., m, d) and k (..., n, d), with the same leading dims."""
    lib, suffix = _load(), _SUFFIX[q.dtype]
    q3, k3 = _batched(q), _batched(k)
    nb, m, d = q3.shape
    n = k3.shape[1]
    out = q.new_empty(nb, m, n)
    scratch = q.new_empty(_BLOCK * d)
    getattr(lib, f"l1_scores_{suffix}")(q3.data_ptr(), k3.data_ptr(), out.data_ptr(),
                                        nb, m, n, d, scratch.data_ptr())
    return out.view(*q.shape[:-1], n)


def grads(ds: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients (dq, dk) of Σ ds·(-‖q-k‖₁), for ds (..., m, n); sign(0) counts as 0."""
    lib, suffix = _load(), _SUFFIX[q.dtype]
    q3, k3, ds3 = _batched(q), _batched(k), _batched(ds)
    nb, m, d = q3.shape
    n = k3.shape[1]
    dq, dk = torch.zeros_like(q3), torch.zeros_like(k3)
    scratch = q.new_empty(2, _BLOCK * d)
    getattr(lib, f"l1_grads_{suffix}")(ds3.data_ptr(), q3.data_ptr(), k3.data_ptr(),
                                       dq.data_ptr(), dk.data_ptr(), nb, m, n, d,
                                       scratch[0].data_ptr(), scratch[1].data_ptr())
    return dq.view(q.shape), dk.view(k.shape)
