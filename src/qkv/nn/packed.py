"""Inference-only linear layers with bf16 or pre-packed weights, for fast CPU inference (as
gpt-fast does on GPU).

- bf16 weights: decoding one token reads every weight once; at batch 1 to 8 that is a
  memory-bound matrix-vector product, so halving the weight bytes (fp32 -> bf16) nearly
  halves the time. Activations stay float32 between layers: each layer rounds its input to
  bf16, multiplies with float32 accumulation, rounds the result to bf16 and adds its float32
  bias.
- float32 weights: the layer's own numbers (up to the order of float32 sums).

Decoding's few rows (up to ``few_rows.MAX_ROWS``) run in qkv's own loop
(``qkv.engines.cpu.few_rows``) on the weight as it is, wherever it builds; bf16 weights there
where the CPU has AVX512-BF16 dot products, or oneDNN has no bf16 products. With bf16 weights
on a 2-core Zen 4 SmolLM2 decodes 1.6-1.7x faster in it than in oneDNN's bf16 product on its
pre-packed weight (docs/performance.md, "Generation"). More rows (a prompt) go to oneDNN, or
to ``F.linear``. Without the loop the weight is pre-packed into oneDNN's blocked layout where
oneDNN runs the dtype's products, which spares a reorder on every call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..engines.cpu import few_rows
from .attention import MultiHeadAttention
from .linear import few_rows_product, float32_inference, linear, onednn_available, onednn_linear

# Rows up to which torch's own CPU bf16 product beats widening the weight to float32 (AVX2,
# Zen 3, a 576 x 1536 layer: 8 rows 0.85 against 0.58 ms, 64 rows 6.9 against 1.7 ms; a
# decoded token at batch 1 reads half the bytes: 17.8 against 12.5 tokens/s for fp32;
# docs/performance.md, "Generation").
_BF16_ROWS = 4


def _onednn_ok(device: torch.device) -> bool:
    """Whether oneDNN runs bf16 linears on this CPU: it needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and refuses to pack a weight otherwise (AVX2-only CPUs such as Zen 3).
    Elsewhere the bf16 weight goes through ``F.linear``: the same rounding, unpacked."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is not None and bool(supported())


_DTYPES = (torch.bfloat16, torch.float32)
# oneDNN's batch-size hint when packing: any batch runs on the packed weight. bf16: decoding's
# one row. float32: 1,024 rows runs as fast as the hint 1 on one row and faster on 8 to 1,024
# (a 1536 x 576 layer on Zen 4: 8 rows 0.11 against 0.18 ms; docs/performance.md,
# "Generation").
_PACK_HINT = {torch.bfloat16: 1, torch.float32: 1024}


def _check_dtype(dtype) -> None:
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32; got {dtype}")


class PackedLinear(nn.Module):
    """An inference-only copy of an ``nn.Linear`` with its weight in ``dtype`` (bf16 or
    float32; packed for oneDNN where it runs that dtype's products).
    x (..., in_features) float -> (..., out_features) in x's dtype. No gradients."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        _check_dtype(dtype)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The dtype activations keep around this layer (a KV cache is allocated in it).
        self.activation_dtype = linear.weight.dtype
        self.dtype = dtype
        weight = linear.weight.detach().to(dtype)
        self.onednn = (_onednn_ok(weight.device) if dtype == torch.bfloat16
                       else weight.device.type == "cpu" and onednn_available())
        # Decoding's few rows run in qkv's loop (``qkv.engines.cpu.few_rows``), which reads
        # the weight as it is; where it takes them, the weight stays unpacked and more rows
        # (a prompt) go to oneDNN with it unpacked. A bf16 weight widened to float32 in the
        # loop loses to oneDNN's bf16 product from 4 rows on (Zen 4), so the loop takes bf16
        # weights only with dot products or where oneDNN has no bf16 products
        # (docs/performance.md, "Generation").
        self.few_row_loop = weight.device.type == "cpu" and few_rows.available() and (
            dtype == torch.float32 or few_rows.bf16_dot_products() or not self.onednn)
        self.packed = self.onednn and not self.few_row_loop
        self.weight = (torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT[dtype])
                       if self.packed else weight)
        self.bias = None if linear.bias is None else linear.bias.detach().float()
        # Without oneDNN's bf16, torch's CPU bf16 product is fast only on a few rows: with
        # more (prefill, batched decoding) the weight is widened to float32 per call.
        self.widen = dtype == torch.bfloat16 and weight.device.type == "cpu" and not self.onednn

    def forward(self, x: Tensor) -> Tensor:
        if self.few_row_operands(x) is not None:
            y = few_rows_product(x, self.weight, self.bias)
            if y is not None:
                return y
        rows = x.reshape(-1, self.in_features).to(self.dtype)
        if self.onednn:
            y = onednn_linear(rows, self.weight)
        elif self.widen and rows.shape[0] > _BF16_ROWS:
            # The same numbers: bf16 inputs, exact float32 products and sums, a bf16 result.
            y = linear(rows.float(), self.weight.float()).to(torch.bfloat16)
        else:
            y = F.linear(rows, self.weight)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def few_row_operands(self, x: Tensor) -> tuple[Tensor, Tensor | None] | None:
        """(weight, bias) where x's product may run in the few-row loop, for
        ``qkv.nn.linear.shared_input``; else None."""
        if self.few_row_loop and float32_inference(x, self.weight, self.bias, self.dtype):
            return self.weight, self.bias
        return None

    def extra_repr(self) -> str:
        packed = "oneDNN-packed " if self.packed else ""
        weight = "bf16" if self.dtype == torch.bfloat16 else "float32"
        return f"in={self.in_features}, out={self.out_features}, {packed}{weight} weight"


def pack_linears(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Replace every ``nn.Linear`` of ``model`` (in place) by a ``PackedLinear`` with its
    weight in ``dtype``: a model for inference only; bf16 is about 2x smaller in weight bytes.
    Returns the model (in eval mode).

    With bf16, the attention layers (``MultiHeadAttention``) also get ``fp32_precision =
    "bf16"``: their float32 q, k, v and softmax weights may be rounded to bf16 for the two
    products, as the linear layers round their inputs. On AMD CPUs with AVX512-BF16 a
    prompt's attention then multiplies in bf16 (the flash engine,
    ``qkv.engines.cpu.cpu_flash``); decoding's few query rows keep float32.

    Tied weights (a GPT's lm_head and token embedding) are untied: the embedding keeps its
    float32 table, the head gets its own packed copy."""
    _check_dtype(dtype)
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, PackedLinear(child, dtype))
        else:
            pack_linears(child, dtype)
    if isinstance(model, MultiHeadAttention) and dtype == torch.bfloat16:
        model.fp32_precision = "bf16"
    return model.eval()
