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
from torch.nn.modules import module as torch_module

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
    if not (_few_row_shape(x, weight, bias) and few_rows.available()):
        return None
    x = _rows_readable(x)
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


def _rows_readable(x: Tensor) -> Tensor:
    """x as the few-row loop reads it: contiguous, or 2-D with unit column stride."""
    return x if x.is_contiguous() or (x.dim() == 2 and x.stride(1) == 1) else x.contiguous()


def _few_row_shape(x: Tensor, weight: Tensor, bias: Tensor | None) -> bool:
    """Whether ``few_rows_product`` takes x by weight (given ``float32_inference``)."""
    k = x.shape[-1]
    return (k > 0 and 0 < x.numel() <= few_rows.MAX_ROWS * k and weight.shape[0] > 0
            and weight.is_contiguous() and (bias is None or bias.is_contiguous()))


def shared_input(x: Tensor, layers: tuple[nn.Module, ...]) -> list[Tensor]:
    """[layer(x) for layer in layers], for 2 or 3 linear layers of the same input x (...,
    in): attention's q, k and v projections, a gated MLP's gate and up. Where the few-row loop
    takes each of them (``few_row_operands``), they run in one call of it, which saves each
    layer's dispatch and start of the thread team (docs/performance.md, "Generation"); the
    outputs are the same as each layer's own. A layer with hooks, or any other case, runs its
    own call (and its hooks)."""
    operands = _few_row_group(x, layers)
    if operands is None:
        return [layer(x) for layer in layers]
    weights, biases = zip(*operands, strict=True)
    return few_rows.few_rows_linears(_rows_readable(x), weights, biases)


def _few_row_group(x: Tensor, layers) -> list | None:
    """Each layer's (weight, bias) for one few-row call, or None where any layer runs its own
    call: torch hooks on it (or on every module), no ``few_row_operands``, a product the loop
    does not take, or weights of different dtypes."""
    # Hooks on every module (torch.nn.modules.module.register_module_forward_hook) run only
    # in a module's own call; a trace keeps each layer's own call (``float32_inference``).
    if (torch.compiler.is_compiling() or torch_module._global_forward_hooks
            or torch_module._global_forward_pre_hooks or not few_rows.available()):
        return None
    operands = []
    for layer in layers:
        if layer._forward_hooks or layer._forward_pre_hooks:
            return None
        found = getattr(layer, "few_row_operands", None)
        found = None if found is None else found(x)
        if found is None or not _few_row_shape(x, *found):
            return None
        operands.append(found)
    dtypes = {weight.dtype for weight, _ in operands}
    return operands if len(dtypes) == 1 else None


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters, state dict and initialization) computing through
    ``linear``. x (..., in_features) -> (..., out_features)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)

    def few_row_operands(self, x: Tensor) -> tuple[Tensor, Tensor | None] | None:
        """(weight, bias) where x's product may leave ``F.linear`` (``float32_inference``),
        for ``shared_input``; else None."""
        return (self.weight, self.bias) if float32_inference(x, self.weight, self.bias) else None
