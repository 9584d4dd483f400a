"""The bf16 CPU engine: dot-product attention's forward with both products in the CPU's bf16
dot-product instruction (AVX512-BF16), for inference.

That instruction multiplies pairs of bf16 into float32 sums at twice float32 FMA's rate.
torch's CPU SDPA does not use it on AMD processors, in float32 or in bf16: on a 2-core Zen 4,
one causal prefill layer of SmolLM2 (9 query heads, 3 KV heads, 1,024 tokens, D = 64) took
about 6 ms here against SDPA's 11.6 ms in float32 and 14.9 ms in bf16 (docs/benchmarks.md).

It runs what it is asked for in bf16 only: bf16 inputs, or float32 inputs with
``fp32_precision="bf16"`` (the caller's consent that q, k, v and the softmax weights be
rounded to bf16, as ``torch.backends.mkldnn.matmul.fp32_precision = "bf16"`` consents for
torch's own float32 products). Scores, softmax and sums stay float32; the output has the
inputs' dtype. Plain or causal attention; no gradients (a call that needs them goes on to
SDPA or the fused engine), and not on a few query rows (decoding), where SDPA's
matrix-vector loops beat packing the keys.
"""

from __future__ import annotations

import ctypes
import functools
import math
import subprocess
from pathlib import Path

import torch
from torch import Tensor

from ..problem import Problem
from ..result import Result
from ..similarity import BUILTIN
from . import native

_DOT = BUILTIN["dot"]
_BN = 128  # BN in cpu_bf16.c: keys per block
_MIN_QUERIES = 16  # below this SDPA's loops were faster than packing K and V
_MAX_D = 256
_P, _I = ctypes.c_void_p, ctypes.c_int64


class _Job(ctypes.Structure):  # struct bf16_job in cpu_bf16.c
    _fields_ = [
        ("q", _P), ("k", _P), ("v", _P),
        ("q_st", _I * 3), ("k_st", _I * 3), ("v_st", _I * 3),
        ("inputs_bf16", _I), ("out", _P), ("out_st", _I * 3), ("lse", _P),
        ("kp", _P), ("vp", _P), ("kp_size", _I), ("vp_size", _I),
        ("batch", _I), ("heads", _I), ("kv_heads", _I), ("nq", _I), ("nk", _I),
        ("d", _I), ("dv", _I), ("causal", _I), ("bm", _I), ("scale_log2", ctypes.c_float),
    ]


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernel, or None: no compiler, or a CPU without AVX512-BF16 (the source is
    built with -march=native and then reports that it has no kernel)."""
    try:
        lib = native.compile_library(Path(__file__).with_suffix(".c").read_text(), "cpu_bf16",
                                     ("-fopenmp",))
    except (OSError, subprocess.SubprocessError):
        return None
    if lib is None:
        return None
    lib.bf16_available.restype = _I
    if not lib.bf16_available():
        return None
    lib.bf16_attention.argtypes = [_P, _P, _I, _I]
    lib.bf16_attention.restype = _I
    return lib


def available() -> bool:
    """Whether this machine runs the bf16 engine (AVX512-BF16 and a C compiler)."""
    return _library() is not None


def _wants_bf16(p: Problem) -> bool:
    dtype = p.q.dtype
    return dtype == torch.bfloat16 or (dtype == torch.float32 and p.fp32_precision == "bf16")


def why_not(p: Problem) -> str | None:
    # Most calls stop at the first two checks: keep them cheap.
    if not _wants_bf16(p):
        return "the bf16 engine takes bf16 inputs, or float32 with fp32_precision='bf16'"
    if p.q.device.type != "cpu":
        return f"the bf16 engine runs CPU tensors; got device {p.q.device}"
    if p.similarity is not _DOT:
        return f"the bf16 engine computes the dot product only, not {p.similarity.name!r}"
    if p.score_mod is not None or p.return_weights or p.dropout_p > 0:
        return "the bf16 engine has no score_mod, return_weights or dropout"
    if p.metric is not None or not isinstance(p.scale, float) or not p.scale > 0:
        return "the bf16 engine needs a plain positive float scale"
    if p.mask is not None and not p.is_causal_only:
        return "the bf16 engine runs only no mask or qkv.causal()"
    if torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v)):
        return "the bf16 engine is for inference: it has no backward"
    if p.nq < _MIN_QUERIES:
        return f"fewer than {_MIN_QUERIES} query rows (decoding): SDPA is faster there"
    d, dv = p.q.shape[3], p.v.shape[3]
    if d % 2 or d > _MAX_D or dv % 16 or dv > _MAX_D:
        return f"the bf16 engine needs D even and Dv a multiple of 16, both <= {_MAX_D}"
    if torch.compiler.is_compiling() or not all(type(t) is Tensor for t in (p.q, p.k, p.v)):
        return "the bf16 engine runs eager tensors only"
    if any(t.stride(3) != 1 for t in (p.q, p.k, p.v)):
        return "the bf16 engine reads rows with unit column stride"
    if not available():
        return "this CPU has no AVX512-BF16 instructions (or there is no C compiler)"
    return None


def _strides(t: Tensor):
    return (_I * 3)(*t.stride()[:3])


def _block_rows(group: int, nq: int) -> int:
    """Query rows per head in a block: the heads of a group stacked give about 64 rows, so
    the score tile (64 x 128 floats) fits a 32 KiB L1 cache. (On the Zen 4, 64 and 128 rows,
    and 64 and 128 keys per block, ran within a few percent of each other.)"""
    return max(1, min(nq, 64, max(8, 64 // group)))


def run(p: Problem) -> Result:
    q, k, v = p.q, p.k, p.v
    batch, heads, kv_heads, nq, nk = p.batch, p.heads, p.kv_heads, p.nq, p.nk
    d, dv = q.shape[3], v.shape[3]
    keys = -(-nk // _BN) * _BN
    out = torch.empty(batch, heads, nq, dv, dtype=q.dtype)
    lse = torch.empty(batch, heads, nq, dtype=torch.float32)
    kp = torch.empty(batch * kv_heads * keys * d, dtype=torch.int16)
    vp = torch.empty(batch * kv_heads * keys * dv, dtype=torch.int16)
    bm = _block_rows(heads // kv_heads, nq)
    job = _Job(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _strides(q), _strides(k), _strides(v),
        q.dtype == torch.bfloat16, out.data_ptr(), _strides(out), lse.data_ptr(),
        kp.data_ptr(), vp.data_ptr(), keys * d, keys * dv,
        batch, heads, kv_heads, nq, nk, d, dv, p.mask is not None, bm,
        p.scale * math.log2(math.e),
    )
    # Costliest blocks first (the last queries under a causal mask), so the last items
    # taken are the short ones.
    items = torch.tensor([(b, g, m0) for m0 in reversed(range(0, nq, bm)) for b in range(batch)
                          for g in range(kv_heads)], dtype=torch.int64)
    _kernel(job, items)
    return Result(out, lse)


def _kernel(job: _Job, items: Tensor) -> None:
    """Pack K and V, then run the query blocks ``items`` (b, g, m0), on torch's threads."""
    failed = _library().bf16_attention(ctypes.byref(job), items.data_ptr(), len(items),
                                       torch.get_num_threads())
    if failed:
        raise MemoryError("the bf16 engine could not allocate its scratch memory")
