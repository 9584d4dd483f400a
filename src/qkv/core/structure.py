"""A variant as structure plus the tensors it reads, so that it can cross a custom op.

A custom op takes tensors and plain values only. Masks, score modifiers and similarities are
objects, so each one is a pytree node (``Node``): flattening gives the tensors it reads (the
leaves: padding lengths, ALiBi slopes, a user's tables, the tensors a user's callable
captures) and its structure (everything else: types, ints, callables). Unflattening the
structure with other tensors rebuilds the same variant reading those: the engines' custom ops
do that with the tensors the op received at run time, after ``torch.compile`` or
``torch.export`` traced the call with fake ones.

A user's callable (a FlexAttention-style ``score_mod``, a mask rule, a similarity term) is
rebuilt by rebinding what it reads: the tensors in its closure cells, the module globals it
names and its defaults; an ``nn.Module`` runs through ``torch.func.functional_call``.
"""

from __future__ import annotations

import types

import torch
import torch.utils._pytree as pytree
from torch import Tensor


def values_readable() -> bool:
    """Whether a check may read tensor values. Not while torch.compile or torch.export
    traces: there a value is unknown and branching on it breaks the graph. Such checks run
    again inside the engines' ops, on the real tensors, with the same messages."""
    return not torch.compiler.is_compiling()


class Node:
    """Base class of every variant object: subclasses register as pytree nodes.

    Attributes that are tensors, nodes, or lists/tuples of them are children; a callable
    that reads tensors becomes a ``BoundCallable`` child; everything else is structure."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        pytree.register_pytree_node(cls, _flatten, lambda leaves, ctx: _unflatten(cls, leaves,
                                                                                   ctx))


def _is_child(value) -> bool:
    if isinstance(value, (Tensor, Node)):
        return True
    return isinstance(value, (list, tuple)) and any(isinstance(v, (Tensor, Node)) for v in value)


def _flatten(obj):
    names, children, structure = [], [], []
    for name, value in vars(obj).items():
        if _is_child(value):
            names.append(name)
            children.append(value)
        elif callable(value) and not isinstance(value, type) and bound_tensors(value):
            names.append(name)
            children.append(BoundCallable(value))
        else:
            structure.append((name, value))
    return children, (tuple(names), tuple(structure))


def _unflatten(cls, children, context):
    names, structure = context
    obj = cls.__new__(cls)
    state = obj.__dict__
    for name, value in zip(names, children, strict=True):
        state[name] = value.fn if isinstance(value, BoundCallable) else value
    state.update(structure)
    return obj


def reads(fn) -> list[tuple[str, object, object]]:
    """(kind, place, value) of every value a function (or bound method) reads from outside
    its arguments: its closure cells ("cell", index), the module globals it names ("global",
    name) and its defaults ("default", index). Other callables read nothing here."""
    inner = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if not isinstance(inner, types.FunctionType):
        return []
    found = []
    for i, cell in enumerate(inner.__closure__ or ()):
        try:
            found.append(("cell", i, cell.cell_contents))
        except ValueError:  # an empty cell
            continue
    names = inner.__globals__
    found += [("global", name, names[name]) for name in inner.__code__.co_names if name in names]
    found += [("default", i, value) for i, value in enumerate(inner.__defaults__ or ())]
    return found


def _captured(fn):
    """(kind, place, tensor) for each tensor ``fn`` reads directly (``reads``); a Module's
    parameters and buffers."""
    if isinstance(fn, torch.nn.Module):
        return [("module", n, t) for n, t in (*fn.named_parameters(), *fn.named_buffers())]
    return [read for read in reads(fn) if isinstance(read[2], Tensor)]


def bound_tensors(fn) -> tuple[Tensor, ...]:
    """The tensors a callable reads that a rebuilt variant rebinds."""
    return tuple(t for _, _, t in _captured(fn))


class BoundCallable:
    """A callable and the tensors it reads, as a pytree node: unflattening rebinds them."""

    def __init__(self, fn):
        self.fn = fn


def _flatten_bound(bound: BoundCallable):
    places = _captured(bound.fn)
    return [t for _, _, t in places], (bound.fn, tuple((kind, name) for kind, name, _ in places))


def _unflatten_bound(tensors, context) -> BoundCallable:
    fn, places = context
    return BoundCallable(rebind(fn, places, list(tensors)))


pytree.register_pytree_node(BoundCallable, _flatten_bound, _unflatten_bound)


def rebind(fn, places, tensors: list[Tensor]):
    """``fn`` reading ``tensors`` where it read the originals (``places`` from _captured)."""
    if isinstance(fn, torch.nn.Module):
        state = {name: t for (_, name), t in zip(places, tensors, strict=True)}
        return lambda *args: torch.func.functional_call(fn, state, args)
    inner = fn.__func__ if isinstance(fn, types.MethodType) else fn
    cells = list(inner.__closure__ or ())
    globals_, defaults = inner.__globals__, list(inner.__defaults__ or ())
    changed_globals = {}
    for (kind, name), t in zip(places, tensors, strict=True):
        if kind == "cell":
            cells[name] = types.CellType(t)
        elif kind == "global":
            changed_globals[name] = t
        else:
            defaults[name] = t
    if changed_globals:
        globals_ = {**globals_, **changed_globals}
    new = types.FunctionType(inner.__code__, globals_, inner.__name__,
                             tuple(defaults) or None, tuple(cells) or None)
    new.__kwdefaults__ = inner.__kwdefaults__
    new.__qualname__ = inner.__qualname__
    if inner is not fn:  # a bound method
        return types.MethodType(new, fn.__self__)
    return new


class Scalar(Node):
    """A Python float of a variant (softcap's cap, a float scale), carried as a 0-d float64
    tensor while the variant crosses a custom op under torch.compile. A float is structure
    to pytree, so a new value would change the op's key; Dynamo makes a float that changes
    symbolic, and a symbolic value cannot be structure. As a tensor it is a value."""

    def __init__(self, value: Tensor):
        self.value = value


def _map_values(obj, fn):
    """A copy of ``obj`` with ``fn`` applied to it and, where ``fn`` leaves it as it is, to
    the attributes of its nodes (and the items of lists and tuples that hold nodes)."""
    mapped = fn(obj)
    if mapped is not obj:
        return mapped
    if isinstance(obj, Node):
        new = obj.__class__.__new__(obj.__class__)
        new.__dict__.update({k: _map_values(v, fn) for k, v in vars(obj).items()})
        return new
    if isinstance(obj, (list, tuple)) and any(isinstance(x, Node) for x in obj):
        return type(obj)(_map_values(x, fn) for x in obj)
    return obj


def floats_as_scalars(obj):
    """``obj`` with its floats as ``Scalar`` tensors (see ``Scalar``)."""
    def wrap(value):
        if isinstance(value, (float, torch.SymFloat)):
            return Scalar(torch.zeros((), dtype=torch.float64) + value)
        return value
    return _map_values(obj, wrap)


def scalars_as_floats(obj):
    """The inverse of ``floats_as_scalars``, where tensors hold values (an op at run time)."""
    return _map_values(obj, lambda v: float(v.value) if isinstance(v, Scalar) else v)
