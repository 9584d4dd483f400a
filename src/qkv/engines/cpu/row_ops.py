"""RMSNorm and RoPE's rotation of a few float32 rows in one C call each (``row_ops.c``):
decoding's small operations between its products, which torch runs as seven and nine
operations.

On a 2-core Zen 4, SmolLM2 decodes a median 1.13x faster at batch 1 with them and 1.05x at
batch 8 (docs/performance.md, "Generation"). Each row is computed from its own input alone,
in a fixed order, so a row's result does not depend on the batch it is in.

Built like the other C sources (``native.optional_library``); without a compiler the
callers (``qkv.nn.norms``, ``qkv.nn.positions``) keep torch's operations.
``QKV_ROW_OPS=0`` turns them off for a process, to compare.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor, nn

from . import build, native
from .few_rows import MAX_ROWS

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _library():
    """The loaded library, or None: off by ``QKV_ROW_OPS=0`` (read once per process), or
    without a C compiler (``native.optional_library``)."""
    if build.forced_choice("QKV_ROW_OPS") is False:
        return None
    lib = native.optional_library(Path(__file__).with_suffix(".c"), "row_ops")
    if lib is None:
        return None
    lib.qkv_rms_norm_rows.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, ctypes.c_float,
                                      _PTR, _I64]
    lib.qkv_rotate_rows.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR,
                                    _I64, _I64, _I64, _I64]
    lib.qkv_rms_norm_rows.restype = lib.qkv_rotate_rows.restype = None
    return lib


def _plain(*tensors: Tensor) -> bool:
    """Float32 CPU tensors or parameters (no subclass: a fake tensor of a trace, a
    distributed tensor keeps torch's dispatch) with no gradient to keep, outside a trace."""
    if not all(type(t) in (Tensor, nn.Parameter) and t.device.type == "cpu"
               and t.dtype == torch.float32 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    return not torch.compiler.is_compiling() and _library() is not None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """x (..., d) * weight (d,) / sqrt(mean(x², -1) + eps) -> a new contiguous (..., d), or
    None where this does not take it: more than ``few_rows.MAX_ROWS`` rows, another dtype,
    device or layout, a gradient to keep, a trace, or the library off."""
    d = x.shape[-1] if x.dim() else 0
    if not (0 < x.numel() <= MAX_ROWS * d and weight.shape == (d,) and weight.is_contiguous()
            and _plain(x, weight)):
        return None
    if x.is_contiguous():
        outer, inner, s_outer, s_inner = 1, x.numel() // d, 0, d
    elif x.dim() == 3 and x.stride(2) == 1:  # a slice of positions: x[:, -1:]
        outer, inner, s_outer, s_inner = x.shape[0], x.shape[1], x.stride(0), x.stride(1)
    else:
        return None
    out = x.new_empty(x.shape)
    _library().qkv_rms_norm_rows(x.data_ptr(), outer, inner, s_outer, s_inner,
                                 weight.data_ptr(), eps, out.data_ptr(), d)
    return out


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor | None:
    """RoPE's x (B, H, N, D) · cos + swap_halves(x) · sin -> a new contiguous (B, H, N, D),
    with cos and sin (N, D) or (B, 1, N, D) as ``qkv.nn.positions.Rotation`` holds them; or
    None where this does not take it (more than ``few_rows.MAX_ROWS`` positions B·N, another
    dtype, device or layout, a gradient to keep, a trace, or the library off)."""
    if x.dim() != 4:
        return None
    b, h, n, d = x.shape
    shaped = (cos.shape == sin.shape and cos.stride() == sin.stride()
              and cos.shape in ((n, d), (b, 1, n, d)) and cos.stride(-1) == 1)
    if not (shaped and d > 0 and d % 2 == 0 and 0 < b * n <= MAX_ROWS and h > 0 and x.stride(3) == 1
            and _plain(x, cos, sin)):
        return None
    batch_stride = cos.stride(0) if cos.dim() == 4 else 0
    out = x.new_empty(x.shape)
    _library().qkv_rotate_rows(x.data_ptr(), x.stride(0), x.stride(1), x.stride(2),
                               cos.data_ptr(), sin.data_ptr(), batch_stride, cos.stride(-2),
                               out.data_ptr(), b, h, n, d)
    return out
