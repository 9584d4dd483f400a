"""Traces of masks, score modifiers and pairwise terms, kept between calls.

Tracing a variant and writing out its code is most of an engine call's host time on small
problems (docs/performance.md, "CPU: host time"). A trace depends on the variant's structure
and on the shapes and types of the tensors it reads, never on their values: the kernels read
those from their slots when they run. So the key is what the variant really reads:
- qkv's own classes: their attributes;
- a user's function: its code object, and what it reads from outside its arguments (its
  closure cells, the module globals its code names, its defaults), each keyed the same way;
- a tensor: its dtype, shape, device and requires_grad, never its values; a hit takes this
  call's tensors into the slots, so a closure over a tensor whose values change between
  steps reads the new values.
A value no key can stand for (an arbitrary object, a dict, a class from outside qkv) makes
the variant untraceable here: it is traced on every call.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Hashable

import torch
from torch import Tensor

from ...core.kept import Kept
from ...core.structure import Node
from .graph import Graph

_PLAIN = (bool, int, str, type(None), torch.dtype, torch.device)


class _NotKeyable(Exception):
    pass


# Values that stand for themselves: a module, a builtin or torch function, a class.
_BY_IDENTITY = (types.ModuleType, types.BuiltinFunctionType, type)


def _key(value, tensors: list[Tensor], depth: int = 0) -> Hashable:
    if depth > 8:  # a function reading itself, or a deep structure: not worth keying
        raise _NotKeyable
    if isinstance(value, Tensor):
        tensors.append(value)
        return (Tensor, value.dtype, tuple(value.shape), value.device, value.requires_grad)
    if isinstance(value, Node):
        cls = type(value)
        if not cls.__module__.startswith("qkv."):
            raise _NotKeyable
        return (cls, tuple((name, _key(v, tensors, depth + 1))
                           for name, v in vars(value).items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_key(v, tensors, depth + 1) for v in value))
    if isinstance(value, float):  # hex: -0.0 and 0.0 differ, nan equals itself
        return (float, value.hex())
    if isinstance(value, _PLAIN):
        return (type(value), value)
    if isinstance(value, types.FunctionType):
        return _function_key(value, tensors, depth)
    if isinstance(value, _BY_IDENTITY) or callable(value) and type(value).__module__ in (
            "torch", "torch._C", "builtins"):
        return (_BY_IDENTITY, value)
    raise _NotKeyable


@functools.lru_cache(maxsize=1024)
def _names(code: types.CodeType) -> tuple[str, ...]:
    """The global names ``code`` and the functions defined inside it may read, sorted (once
    per code object: every call of a keyed variant asks)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_names(const))
    return tuple(sorted(names))


def _function_key(fn: types.FunctionType, tensors: list[Tensor], depth: int) -> Hashable:
    """A user function's key: its code, and the key of each value it reads from outside its
    arguments, in a fixed order."""
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_key(cell.cell_contents, tensors, depth + 1))
        except ValueError:  # an empty cell: a name assigned later in the enclosing function
            raise _NotKeyable from None
    scope = fn.__globals__
    read = tuple((name, _key(scope[name], tensors, depth + 1))
                 for name in _names(fn.__code__) if name in scope)
    defaults = tuple(_key(v, tensors, depth + 1) for v in fn.__defaults__ or ())
    kwdefaults = tuple((name, _key(v, tensors, depth + 1))
                       for name, v in sorted((fn.__kwdefaults__ or {}).items()))
    return (types.FunctionType, fn.__code__, tuple(cells), read, defaults, kwdefaults)


def variant_key(*parts) -> tuple[Hashable, list[Tensor]] | None:
    """A key for the trace of ``parts`` (masks, score modifiers, pairwise terms, None) and
    the tensors they read, in a fixed order; None when a part reads a value no key stands
    for."""
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
        slot of ``graph`` is not one of ``tensors`` (a tensor made while tracing), or one of
        ``tensors`` is not a slot: the trace may then have read its values (``.item()``),
        which the key does not hold."""
        index = {id(t): i for i, t in enumerate(tensors)}
        sources = tuple(index.get(id(t), -1) for t in graph.sources)
        if -1 not in sources and len(set(map(id, graph.sources))) == len(index):
            self._kept.keep(key, (value, sources))

    def values(self) -> list:
        """The values kept, least recently used first."""
        return [value for value, _ in self._kept.values()]

    def clear(self) -> None:
        self._kept.clear()

    def __len__(self) -> int:
        return len(self._kept)
