"""Traces of qkv's own masks and score modifiers, kept between calls.

Tracing a variant and writing out its code is most of an engine call's host time on small
problems: ALiBi traced twice per Triton forward, and half of a CPU decode step with ALiBi
(docs/benchmarks.md). A trace depends on the variant's structure and on the shapes and
types of the tensors it reads, never on their values: the kernels read those from their
slots when they run. qkv's own mask and modifier classes read nothing but their attributes,
so those attributes, with each tensor's dtype, shape, device and requires_grad, key the
trace; a hit takes this call's tensors into the slots.

A user's callable can read any Python value (a global, a closure cell) that no key sees, and
so can a subclass defined outside qkv: variants holding one are traced on every call.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from ...core.structure import Node
from ..kept import Kept
from .graph import Graph

_PLAIN = (bool, int, str, type(None), torch.dtype, torch.device)


class _NotKeyable(Exception):
    pass


def _key(value, tensors: list[Tensor]) -> Hashable:
    if isinstance(value, Tensor):
        tensors.append(value)
        return (Tensor, value.dtype, tuple(value.shape), value.device, value.requires_grad)
    if isinstance(value, Node):
        cls = type(value)
        if not cls.__module__.startswith("qkv."):
            raise _NotKeyable
        return (cls, tuple((name, _key(v, tensors)) for name, v in vars(value).items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key(v, tensors) for v in value))
    if isinstance(value, float):  # hex: -0.0 and 0.0 differ, nan equals itself
        return (float, value.hex())
    if isinstance(value, _PLAIN):
        return (type(value), value)
    raise _NotKeyable


def variant_key(*parts) -> tuple[Hashable, list[Tensor]] | None:
    """A key for the trace of ``parts`` (masks, score modifiers, None) and the tensors they
    read, in a fixed order; None when a part holds a user's callable or a class from
    outside qkv."""
    tensors: list[Tensor] = []
    try:
        key = tuple(_key(part, tensors) for part in parts)
    except _NotKeyable:
        return None
    # A tensor read in two places is one slot: which places share a tensor is structure too.
    first: dict[int, int] = {}
    shared = tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))
    return (key, shared), tensors


class Traces:
    """The last ``size`` traces by key, each with where its slots came from. Calls from
    several threads share it."""

    def __init__(self, size: int = 128):
        self._kept = Kept(size)

    def lookup(self, key: Hashable, tensors: list[Tensor], device) -> tuple[object, list] | None:
        """(value, slots) stored under ``key``, the slots taken from ``tensors`` (this call's,
        in ``variant_key``'s order) as the trace took them; None on a miss."""
        entry = self._kept.get(key)
        if entry is None:
            return None
        value, sources = entry
        return value, [Graph.place(tensors[i], device) for i in sources]

    def store(self, key: Hashable, tensors: list[Tensor], value, graph: Graph) -> None:
        """Keep ``value`` (which must not hold the slots themselves) for ``key``, unless a
        slot of ``graph`` is not one of ``tensors`` (a tensor made while tracing)."""
        index = {id(t): i for i, t in enumerate(tensors)}
        sources = tuple(index.get(id(t), -1) for t in graph.sources)
        if -1 not in sources:
            self._kept.keep(key, (value, sources))

    def values(self) -> list:
        """The values kept, least recently used first."""
        return [value for value, _ in self._kept.values()]

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
