"""The product of a few rows by a linear layer's float32 or bf16 weight
(``few_rows_linear.c``): decoding's products, which stream the weight once and are bound by
memory bandwidth.

On a 2-core Zen 4 it takes 0.34-0.55x the time of MKL's ``F.linear`` (SmolLM2's weights, 1 to
8 rows) and 0.39-0.75x oneDNN's; its AVX2 build takes 0.29-0.71x MKL's there. With a bf16
weight it takes 0.37-0.98x the time of oneDNN's bf16 product on a pre-packed weight at 1 to
16 rows, the head at 16 rows aside (docs/performance.md, "Generation"). Each output row is
computed from its own input row only, in a fixed order, so a row's result does not depend on
the batch it is in, nor on the thread count.

Built like the other C sources (``native.optional_library``, with OpenMP: its threads are
those of torch's team). ``QKV_FEW_ROWS_LINEAR=0`` turns it off for a process, to compare.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

from . import build, native

# Rows up to which the loop takes the product, beside MKL and oneDNN alike: on a 2-core Zen 4
# at 16 rows it takes 0.49-0.70x MKL's time and, in two runs, 0.54-0.97x oneDNN's on each of
# SmolLM2's weights; at 32 rows 0.67-0.92x MKL's but up to 1.23x oneDNN's (docs/performance.md,
# "Generation").
MAX_ROWS = 16

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_UNUSED_PART = (None, None, None, 0)  # (weight, bias, y, n) of a product the call leaves out


@functools.cache
def _library():
    """The loaded library, or None: off by ``QKV_FEW_ROWS_LINEAR=0`` (read once per process),
    or without a C compiler or OpenMP (``native.optional_library``)."""
    if build.forced_choice("QKV_FEW_ROWS_LINEAR") is False:
        return None
    lib = native.optional_library(Path(__file__).with_name("few_rows_linear.c"),
                                  "few_rows_linear", ("-fopenmp",))
    if lib is None:
        return None
    # x, its row stride, rows, k, threads, bf16, count, then (weight, bias, y, n) three times.
    lib.qkv_few_rows_linear.argtypes = [_PTR] + [_I64] * 6 + [_PTR, _PTR, _PTR, _I64] * 3
    lib.qkv_few_rows_linear.restype = ctypes.c_int
    lib.qkv_few_rows_bf16_dot_products.argtypes = []
    lib.qkv_few_rows_bf16_dot_products.restype = ctypes.c_int
    return lib


def available() -> bool:
    """Whether the few-row product runs in this process."""
    return _library() is not None


def bf16_dot_products() -> bool:
    """Whether bf16 weights meet x in AVX512-BF16 dot products (the build's target has them),
    rather than being widened to float32 first, which is compute-bound from 4 rows on."""
    return available() and bool(_library().qkv_few_rows_bf16_dot_products())


def few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) float32 @ weight (out, in)ᵀ contiguous float32 + bias (out,) contiguous
    float32 -> (..., out), on torch's thread count. x is contiguous, or 2-D with unit column
    stride; the caller (``qkv.nn.linear``) checks the layouts, dtypes and that
    ``available()``. Decoding makes 200-odd of these calls a token, each a few microseconds
    of work, so nothing here reshapes or views."""
    return few_rows_linears(x, (weight,), (bias,))[0]


def few_rows_linear_bf16(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``few_rows_linear`` with weight (out, in) contiguous bfloat16, as a bf16 layer with a
    float32 bias computes it (``qkv.nn.packed``): x rounded to bf16, exact products summed in
    float32 (denormals as zero where AVX512-BF16's dot products run them, as in oneDNN's),
    each output rounded to bf16, then + bias. Returns float32 (..., out): half the weight
    bytes of the float32 loop, and no conversions around the call."""
    return few_rows_linears(x, (weight,), (bias,))[0]


def few_rows_linears(x: Tensor, weights: tuple[Tensor, ...],
                     biases: tuple[Tensor | None, ...]) -> list[Tensor]:
    """[x @ w_iᵀ + b_i] for 1 to 3 weights of the same dtype (float32 or bfloat16, each
    contiguous (out_i, in)) by the same x, in one call and one start of the thread team:
    attention's q, k and v projections, a gated MLP's gate and up. Each output is what
    ``few_rows_linear`` (or ``few_rows_linear_bf16``) gives it alone; layouts as there."""
    k = x.shape[-1]
    rows, lead = x.numel() // k, x.shape[:-1]
    ys = [x.new_empty(*lead, w.shape[0]) for w in weights]
    parts = []
    for w, b, y in zip(weights, biases, ys, strict=True):
        parts += (w.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), w.shape[0])
    parts += _UNUSED_PART * (3 - len(weights))
    status = _library().qkv_few_rows_linear(
        x.data_ptr(), x.stride(0) if x.dim() == 2 else k, rows, k, torch.get_num_threads(),
        weights[0].dtype == torch.bfloat16, len(weights), *parts)
    if status == -1:
        raise MemoryError(f"few_rows_linear_bf16: no memory for x's {rows} x {k} bf16 copy")
    if status:
        raise ValueError(f"few_rows_linears takes 1 to 3 weights; got {len(weights)}")
    return ys
