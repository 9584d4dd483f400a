"""The flash CPU engine: plain and causal dot-product attention's forward (inference) in
AVX-512 micro-kernels (``cpu_flash.c``), on AMD processors.

torch's CPU SDPA multiplies through MKL, which runs its AVX2 code on AMD processors and never
uses the bf16 dot-product instruction (AVX512-BF16). On a 2-core Zen 4, one causal prefill
layer of SmolLM2 (9 query heads, 3 KV heads, 1,024 tokens, D = 64) takes 0.75x SDPA's time
here with float32 products and 0.45x with bf16 products (docs/performance.md, "CPU: flash
engine").

Which products:
- bf16 inputs, or float32 inputs with ``fp32_precision="bf16"`` (the caller's consent that
  q, k, v and the softmax weights be rounded to bf16, as ``torch.backends.mkldnn.matmul.
  fp32_precision = "bf16"`` consents for torch's own float32 products): bf16 products, on
  CPUs with AVX512-BF16. Without it, float32 inputs get float32 products.
- float32 inputs otherwise: float32 products (AVX-512 FMA), within a few float32 ulp of SDPA,
  under a causal mask with Nk <= 2 Nq only: plain float32 attention runs at SDPA's own speed
  with them (1.02x), and few queries against many keys slower.
Scores, softmax and sums are float32 either way; the output has the inputs' dtype.

Only on AMD processors, where it is measured; on Intel's, MKL and oneDNN run AVX-512 (and
AMX) themselves, and the engine is not enabled there until measured (docs/portability.md).
Plain or causal attention, no gradients (a call that needs them goes on to SDPA or the fused
engine), and from 128 query rows (a prompt): on fewer, and in decoding, SDPA is faster than
packing the keys.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import torch
from torch import Tensor

from ...core.problem import Problem
from ...core.result import Result
from ...core.similarity import BUILTIN
from . import build, native

_DOT = BUILTIN["dot"]
# Below this many query rows SDPA is as fast or faster (packing K and V, and the call's own
# overhead, are not paid back): docs/performance.md, "CPU: flash engine".
_MIN_QUERIES = 128
_MAX_D = 256
_P, _I = ctypes.c_void_p, ctypes.c_int64
# Products -> the compiler flags that build cpu_flash.c for them.
_FLAGS = {"bf16": ("-fopenmp",), "fp32": ("-fopenmp", "-DQKV_FP32_PRODUCTS")}


class _Job(ctypes.Structure):  # struct flash_job in cpu_flash.c
    _fields_ = [
        ("q", _P), ("k", _P), ("v", _P),
        ("q_st", _I * 3), ("k_st", _I * 3), ("v_st", _I * 3),
        ("inputs_bf16", _I), ("out", _P), ("out_st", _I * 3), ("lse", _P),
        ("batch", _I), ("heads", _I), ("kv_heads", _I), ("nq", _I), ("nk", _I),
        ("d", _I), ("dv", _I), ("causal", _I), ("bm", _I), ("scale_log2", ctypes.c_float),
    ]


# What each kind of product needs of the build target.
_NEEDS = {"bf16": "AVX512-BF16", "fp32": "AVX-512"}


@functools.cache
def _library(products: str) -> ctypes.CDLL | str:
    """The kernel with ``products`` ("bf16" or "fp32"), or why this machine has none.
    ``QKV_FLASH=1`` or ``0`` forces the choice of CPU vendor (read once per process), to
    measure the engine on another vendor's CPU or compare a call without it."""
    forced = build.forced_choice("QKV_FLASH")
    if forced is False:
        return "QKV_FLASH=0 turns it off"
    if forced is None and not build.amd_cpu():
        return ("it runs on AMD CPUs only: it was measured there, and is not enabled on others "
                "until measured (on Intel's, MKL and oneDNN run AVX-512 themselves; "
                "QKV_FLASH=1 enables it to measure it)")
    if not native.available(torch.float32):
        return ("the C kernels are off here (QKV_NATIVE=0, no C compiler, a failed build or a "
                "QKV_MARCH this CPU lacks: qkv's warning said which)")
    lib = native.optional_library(Path(__file__).with_suffix(".c"), f"cpu_flash_{products}",
                                  _FLAGS[products])
    if lib is None:
        return "cpu_flash.c did not build (it needs a compiler with -fopenmp)"
    lib.flash_available.restype = _I
    if not lib.flash_available():
        return f"it needs {_NEEDS[products]}, which -march={build.march()} does not have here"
    lib.flash_attention.argtypes = [_P, _I]
    lib.flash_attention.restype = _I
    return lib


def available(products: str) -> bool:
    """Whether this machine runs the engine with ``products`` ("bf16": an AMD CPU with
    AVX512-BF16; "fp32": with AVX-512F; a C compiler with OpenMP either way)."""
    return not isinstance(_library(products), str)


def products_of(p: Problem) -> str | None:
    """The products the engine would run ``p`` with, or None for inputs it does not take."""
    dtype = p.q.dtype
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype != torch.float32:
        return None
    return "bf16" if p.fp32_precision == "bf16" and available("bf16") else "fp32"


def why_not(p: Problem) -> str | None:
    # The device and eager mode first: products_of may build the CPU kernels, which a CUDA
    # call never needs, and a traced call must not reach the C library.
    if p.q.device.type != "cpu":
        return f"the flash engine runs CPU tensors; got device {p.q.device}"
    if torch.compiler.is_compiling() or not all(type(t) is Tensor for t in (p.q, p.k, p.v)):
        return "the flash engine runs eager tensors only"
    products = products_of(p)
    if products is None:
        return f"the flash engine takes float32 or bf16 inputs; got {p.q.dtype}"
    # The machine before the call: where there is no kernel, no change to the call helps.
    if isinstance(lib := _library(products), str):
        return f"the flash engine has no {products} kernel here: {lib}"
    if not p.weighting.is_softmax:
        return f"the flash engine computes softmax only, not the weighting {p.weighting!r}"
    if p.similarity is not _DOT:
        return f"the flash engine computes the dot product only, not {p.similarity.name!r}"
    if p.score_mod is not None or p.return_weights or p.dropout_p > 0:
        return "the flash engine has no score_mod, return_weights or dropout"
    if p.metric is not None or not isinstance(p.scale, float) or not p.scale > 0:
        return "the flash engine needs a plain positive float scale"
    if p.mask is not None and not p.is_causal_only:
        return "the flash engine runs only no mask or qkv.causal()"
    if products == "fp32" and (p.mask is None or p.nk > 2 * p.nq):
        # Plain attention ran at SDPA's own speed (1.02x), and 256 causal queries against 4,096
        # keys 1.28x slower: float32 products gain only on the causal diagonal's blocks.
        return ("float32 products gain only under a causal mask with Nk <= 2 Nq; SDPA is as "
                "fast or faster otherwise")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (p.q, p.k, p.v)):
        return "the flash engine is for inference: it has no backward"
    if p.nq < _MIN_QUERIES:
        return f"fewer than {_MIN_QUERIES} query rows (decoding, short prompts): SDPA is faster"
    d, dv = p.q.shape[3], p.v.shape[3]
    if d % 2 or d > _MAX_D or dv % 16 or dv > _MAX_D:
        return f"the flash engine needs D even and Dv a multiple of 16, both <= {_MAX_D}"
    if any(t.stride(3) != 1 for t in (p.q, p.k, p.v)):
        return "the flash engine reads rows with unit column stride"
    return None


def _strides(t: Tensor):
    return (_I * 3)(*t.stride()[:3])


def _block_rows(group: int, nq: int) -> int:
    """Query rows per head in a block: the heads of a group stacked give about 64 rows, so
    the score tile (64 x 128 floats) fits a 32 KiB L1 cache. (On the Zen 4, 64 and 128 rows,
    and 64 and 128 keys per block, run within a few percent of each other.)"""
    return max(1, min(nq, 64, max(8, 64 // group)))


def run(p: Problem) -> Result:
    q, k, v = p.q, p.k, p.v
    batch, heads, kv_heads, nq = p.batch, p.heads, p.kv_heads, p.nq
    d, dv = q.shape[3], v.shape[3]
    out = torch.empty(batch, heads, nq, dv, dtype=q.dtype)
    lse = torch.empty(batch, heads, nq, dtype=torch.float32)
    job = _Job(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), _strides(q), _strides(k), _strides(v),
        q.dtype == torch.bfloat16, out.data_ptr(), _strides(out), lse.data_ptr(),
        batch, heads, kv_heads, nq, p.nk, d, dv, p.mask is not None,
        _block_rows(heads // kv_heads, nq), p.scale * math.log2(math.e),
    )
    _kernel(products_of(p), job)
    return Result(out, lse)


def _kernel(products: str, job: _Job) -> None:
    """Pack K and V, then run every query block, on torch's threads."""
    if _library(products).flash_attention(ctypes.byref(job), torch.get_num_threads()):
        raise MemoryError("the flash engine could not allocate its memory")
