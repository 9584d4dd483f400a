"""The Triton engine: fused FlashAttention-2 style kernels, forward and backward, for every
similarity, mask and score modifier, compiled from their single definitions.

Importing this package does not import Triton; ``run`` does, on first use.
"""

from __future__ import annotations

import importlib.util

import torch

from ...core.problem import Problem
from ..kernelgen.graph import CompileError
from ..lowering import WeightsKind, lowered_variant, weights_kind
from .traced import trace_functions

__all__ = ["MAX_HEAD_DIM", "plan", "unsupported"]

MAX_HEAD_DIM = 256  # D and Dv; the kernels pad both to a power of two

# Looked up once: Dynamo refuses to trace importlib (torch 2.11 skips find_spec), and
# ``unsupported`` runs inside a compiled qkv.attention on CUDA tensors.
HAS_TRITON = importlib.util.find_spec("triton") is not None


def unsupported(p: Problem) -> str | None:
    """Why the kernels cannot run this problem on any device (None if they can).

    The variant is traced here to find out; where the kernels run, on the tensors they
    receive (inside a custom op under torch.compile), that trace is found again
    (``traced.trace_functions``), or traced again when its functions read values no memo
    key stands for. While torch.compile
    traces, Dynamo cannot follow qkv's own tracer, so the variant is not traced here: one the
    Triton tracer cannot compile raises its reason when the compiled call first runs,
    instead of falling back to another engine."""
    if not HAS_TRITON:
        return "triton is not installed"
    if p.q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        return f"the Triton kernels run float32, float16 and bfloat16, not {p.q.dtype}"
    if p.return_weights and _needs_grad(p):
        return (
            "return_weights=True while gradients are needed: the Triton engine recomputes the "
            "weights from its log-sum-exp without a gradient; use backend='reference'"
        )
    variant = lowered_variant(p, None)
    kind = weights_kind(variant)
    if kind is None:
        return f"the Triton kernels have no loop for the weighting {p.weighting!r}"
    if kind == WeightsKind.STICK and not variant.term.products:
        # Its key gradients are added by the query tiles; the chunked terms' key rows are
        # written by one program each.
        return (f"the Triton kernels break the stick with the matrix-product terms only "
                f"(dot, cosine, l2, mahalanobis), not the similarity {p.similarity!r}")
    if p.nq == 0 or p.nk == 0:
        return "an empty sequence"
    dims = (p.q.shape[-1], p.v.shape[-1])
    if max(dims) > MAX_HEAD_DIM:
        return f"head dims up to {MAX_HEAD_DIM} are supported; got D={dims[0]}, Dv={dims[1]}"
    if torch.compiler.is_compiling():
        return None
    try:
        trace_functions(variant, p.q.device, p.q.shape[-1], max(p.nq, p.nk))
    except CompileError as e:
        return str(e)
    return None


def _needs_grad(p: Problem) -> bool:
    return torch.is_grad_enabled() and any(
        t.requires_grad for t in (p.q, p.k, p.v, *p.grad_tensors())
    )


def plan(p: Problem, *, on_cpu: bool = False):
    """A runner for ``p``, or the reason the kernels cannot run it. CPU tensors always get a
    reason unless ``on_cpu`` (Triton's slow interpreter, which tests ask for)."""
    if not (p.q.is_cuda or on_cpu):
        return "the Triton engine runs on CUDA tensors"
    reason = unsupported(p)
    if reason is not None:
        return reason
    from .function import run  # imports triton

    return lambda: run(p)
