"""``Linear``: ``nn.Linear`` whose float32 inference products run in qkv's few-row loop when
x has a few rows (decoding), and in oneDNN on AMD CPUs with AVX-512 otherwise.

A product of a few rows (up to ``few_rows.MAX_ROWS``) streams the weight once and is bound by
memory bandwidth. qkv's loop (``qkv.engines.cpu.few_rows``) reads it at 2.1-2.9x MKL's rate and
1.3-2.6x oneDNN's on a Zen 4 (1 to 8 rows), and its AVX2 build beats MKL there too. It is plain
vector code with no vendor's library under it, so it runs wherever it builds
(``QKV_FEW_ROWS_LINEAR=0`` turns it off, to compare with MKL on a CPU not measured yet, such
as Intel's).

torch's float32 ``F.linear`` on x86 calls MKL, and MKL leaves AVX-512 unused on AMD
processors. On a 2-core Zen 4 (AVX-512), oneDNN's product of the same operands (through the
op that torch's own compiler emits for CPU linears) takes 0.80–0.85x MKL's time on SmolLM2's
shapes at 1,024 rows, and 0.65–0.75x on decoding's 1 to 17 rows (docs/performance.md,
"Generation"). The two differ only in the
order of the float32 sums: a few ulp, as MKL's own row counts differ among themselves.

Everything else goes through ``F.linear`` unchanged: autograd (training), ``torch.compile``
and export (the compiler picks its own kernels; the graph holds ``aten.linear``), autocast,
tensor subclasses, other dtypes and devices, and the
CPUs where oneDNN is not known to be faster: Intel's (MKL's own code path) and AMD's without
AVX-512 (there both libraries run AVX2 code).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..engines.cpu import few_rows
from ..engines.cpu.build import amd_cpu, forced_choice


@functools.cache
def onednn_available() -> bool:
    """Whether this CPU takes float32 inference products through oneDNN (an AMD CPU with
    AVX-512, and a torch built with oneDNN). ``QKV_ONEDNN_LINEAR=1`` or ``0`` forces the
    choice on any CPU (read once per process), for comparisons."""
    if not torch.backends.mkldnn.is_available():
        return False
    forced = forced_choice("QKV_ONEDNN_LINEAR")
    if forced is not None:
        return forced
    return torch.backends.cpu.get_cpu_capability() == "AVX512" and amd_cpu()


def float32_inference(x: Tensor, weight: Tensor, bias: Tensor | None,
                      weight_dtype: torch.dtype = torch.float32) -> bool:
    """Whether the product may leave ``F.linear``: plain float32 CPU tensors (the weight in
    ``weight_dtype``) of matching widths, no gradient, no compiler, no autocast."""
    # A subclass (a fake tensor of a trace, a user's) keeps F.linear and its own dispatch.
    if not (type(x) is Tensor and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == weight_dtype
            and x.layout == weight.layout == torch.strided and weight.dim() == 2):
        return False
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != weight.shape[:1]):
        return False
    # Mismatched widths go to F.linear, which names them (oneDNN says only that it failed).
    if x.dim() == 0 or x.shape[-1] != weight.shape[1]:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return False
    return not (torch.compiler.is_compiling() or torch.is_autocast_enabled("cpu"))


def few_rows_product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor | None:
    """x (..., in) @ weight (out, in)ᵀ + bias in the few-row loop (a float32 or a bfloat16
    weight; ``float32_inference`` holds), or None where it does not take the product (more
    rows, an empty or non-contiguous operand, the loop not built)."""
    k = x.shape[-1]
    if not (k > 0 and 0 < x.numel() <= few_rows.MAX_ROWS * k and weight.shape[0] > 0
            and weight.is_contiguous() and (bias is None or bias.is_contiguous())
            and few_rows.available()):
        return None
    if not (x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1)):
        x = x.contiguous()
    if weight.dtype == torch.bfloat16:
        return few_rows.few_rows_linear_bf16(x, weight, bias)
    return few_rows.few_rows_linear(x, weight, bias)


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., in) @ weight (out, in)ᵀ + bias (out,) -> (..., out) in oneDNN, with no
    activation after it; ``weight`` dense, or packed by ``mkldnn._reorder_linear_weight``."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear``: x (..., in) @ weight (out, in)ᵀ + bias (out,) -> (..., out), in the
    few-row loop or oneDNN where that is faster (module docstring), else in ``F.linear``."""
    if float32_inference(x, weight, bias):
        y = few_rows_product(x, weight, bias)
        if y is not None:
            return y
        if onednn_available():
            return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, state dict and initialization) computing through
    ``linear``. x (..., in_features) -> (..., out_features)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
