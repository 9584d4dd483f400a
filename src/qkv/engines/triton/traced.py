"""A lowered variant's Triton functions: its mask, score modifier and pairwise term (when the
kernels have no code of their own for it) traced into one Triton module's source (no Triton
import needed), once per variant and shape class (``kernelgen.memo``)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from ..kernelgen import memo
from ..kernelgen.graph import CompileError, Graph
from ..kernelgen.trace import trace_mask, trace_score_mod, trace_term
from ..kernelgen.triton import generate_source
from ..kernelgen.triton_emit import POSITION_LIMIT
from ..lowering import Lowered, TermKind


@dataclass
class TracedFunctions:
    """The Triton source of a variant's functions and the tensors they read."""

    source: str
    has_mask: bool
    has_mod: bool
    has_term: bool  # a pairwise term without Triton code of its own, traced
    slots: list[Tensor]  # the captured tensors, on the problem's device
    grad_slots: set[int]  # float slots that need a gradient


def _trace(what: str, obj, trace, graph: Graph):
    try:
        return trace(obj, graph)
    except CompileError as e:
        raise CompileError(f"cannot compile {what} {obj!r} for Triton: {e}") from None
    except Exception as e:  # user code doing something the tracer does not model
        raise CompileError(
            f"cannot compile {what} {obj!r} for Triton: tracing it raised {type(e).__name__}: {e}"
        ) from None


_TRACES = memo.Traces()


def trace_functions(variant: Lowered, device: torch.device, head_dim: int,
                    positions: int) -> TracedFunctions:
    """``variant``'s pairwise term (unless the kernels have its code), mask and score modifier
    on ``device`` with query head dim ``head_dim`` and ``positions`` = max(Nq, Nk),
    traced into one Triton module (or found traced, ``memo``). Raises CompileError naming
    what cannot be compiled."""
    pair, mask, score_mod, kind = variant.pair, variant.mask, variant.score_mod, variant.term
    float_positions = positions <= POSITION_LIMIT
    keyed = memo.variant_key(pair.term if kind == TermKind.TRACED else None, mask, score_mod)
    if keyed is not None:
        key = (kind, keyed[0], device, head_dim, float_positions, torch.is_grad_enabled())
        found = _TRACES.lookup(key, keyed[1], device)
        if found is not None:
            traced, slots = found
            if _grad_slots(slots) == traced.grad_slots:
                return replace(traced, slots=slots)
    graph = Graph(device, head_dim)
    term_root = (
        None if kind != TermKind.TRACED
        else _trace("the pairwise term", pair.term, trace_term, graph)
    )
    mask_root = None if mask is None else _trace("mask", mask, trace_mask, graph)
    mod_root = (
        None if score_mod is None
        else _trace("score_mod", score_mod, trace_score_mod, graph)
    )
    grad_slots = _grad_slots(graph.slots)
    traced = TracedFunctions(
        source=generate_source(mask_root, mod_root, grad_slots, term_root, float_positions),
        has_mask=mask_root is not None,
        has_mod=mod_root is not None,
        has_term=term_root is not None,
        slots=graph.slots,
        grad_slots=grad_slots,
    )
    if keyed is not None:
        _TRACES.store(key, keyed[1], replace(traced, slots=[]), graph)
    return traced


def _grad_slots(slots: list[Tensor]) -> set[int]:
    return {i for i, t in enumerate(slots) if t.is_floating_point() and t.requires_grad}
