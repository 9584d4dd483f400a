"""The fused engines as ``torch.library`` custom ops, so that ``torch.compile`` and
``torch.export`` keep them instead of falling back to the O(N²) reference.

An engine's kernels read the variant (``lowering.Lowered``: mask, score modifier, pairwise
term, scale) as Python objects, and a custom op takes only tensors and plain values. So the
variant crosses the op as a key plus the tensors it reads (``structure``): the key names its
structure in a registry, written when the call is traced, and the op rebuilds the variant
from it and the tensors it receives at run time. Gradients reach every one of those
tensors, because they are the op's inputs.

Each engine gives an ``EngineKernels``: forward and backward over features q (B, H, Nq, D),
k (B, Hk, Nk, D), v (B, Hk, Nk, Dv). ``define`` registers them and returns the engine's
``EngineOp``, whose ``run`` calls them:
- in eager mode, through an autograd Function that holds the variant itself (no registry
  entry per call: a model that builds a fresh lambda each step would otherwise grow it), or,
  with grad mode off, the kernels directly (inference: no leaves to find, no graph node);
- under torch.compile or torch.export, through the ops ``qkv::<engine>_forward`` and
  ``qkv::<engine>_backward``, behind a ``nonstrict_trace`` boundary so that the registry is
  written for real while Dynamo traces, and the ops' arguments are plain.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from ..core.structure import floats_as_scalars, scalars_as_floats
from .lowering import Lowered


@dataclass(frozen=True)
class EngineKernels:
    """forward(q, k, v, variant, dropout_p, want_weights) -> (out, lse, weights or None, seed);
    backward(dout, dlse or None, q, k, v, out, lse, seed, variant, dropout_p, wanted) ->
    (dq, dk, dv, [gradient of each tensor in ``wanted``]), where ``wanted`` are the variant's
    tensors that need one (the variant reads exactly those objects);
    lse_like(q) -> the lse an op returns, empty, for shapes only."""

    forward: Callable
    backward: Callable
    lse_like: Callable[[Tensor], Tensor]


def grads_of_wanted(wanted, extras, dextras) -> list[Tensor | None]:
    """Gradients of ``wanted`` from those of ``extras``: the same tensor, or one the tracer
    derived from it (a contiguous copy), through autograd."""
    direct = {id(t): None if g is None else g.to(t.dtype)  # sums may be float64
              for t, g in zip(extras, dextras, strict=True)}
    grads = [direct.pop(id(t), None) for t in wanted]
    derived = [(e, direct[id(e)]) for e in extras if direct.get(id(e)) is not None]
    if derived and wanted:
        more = torch.autograd.grad([e for e, _ in derived], wanted, [g for _, g in derived],
                                   allow_unused=True)
        grads = [a if b is None else b if a is None else a + b
                 for a, b in zip(grads, more, strict=True)]
    return grads


_SPECS: dict = {}  # variant structure (a pytree spec) -> key
_BY_KEY: dict[str, object] = {}
_OPS: dict[str, object] = {}


def _key(spec) -> str:
    key = _SPECS.get(spec)
    if key is None:
        key = _SPECS[spec] = f"v{len(_SPECS)}"
        _BY_KEY[key] = spec
    return key


def _rebuild(leaves, key: str) -> Lowered:
    if key not in _BY_KEY:
        raise RuntimeError(
            f"qkv: variant {key!r} is not known in this process: a program exported with qkv's "
            "ops runs in the process that traced it")
    return scalars_as_floats(pytree.tree_unflatten(list(leaves), _BY_KEY[key]))


def _removable(key) -> bool:
    try:
        torch._C._dispatch_tls_local_exclude_set().remove(key)
    except (RuntimeError, ValueError):
        return False
    return True


# Every dispatch key but autocast's: an op's implementation runs below them all.
_ABOVE_KERNELS = tuple(key for name, key in torch._C.DispatchKey.__members__.items()
                       if not name.startswith("Autocast") and _removable(key))


@contextlib.contextmanager
def _as_in_eager():
    """The dispatcher as in plain eager mode, inside an op's implementation.

    A custom op runs below the autograd keys, and below functorch's and Python's too when a
    dispatch mode is active; AOTAutograd runs compiled graphs under one, with
    ``__torch_function__`` off. The kernels are eager code: they differentiate small pieces
    (a tile's score modifier, a traced term) with ``torch.autograd.grad``, map a user's
    callable with ``torch.vmap`` and trace variants through ``__torch_function__``. Without
    this, those gradients come out zero, vmap fails and tracing sees no symbolic values."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _ABOVE_KERNELS:
        exclude = exclude.remove(key)
    include = torch._C._dispatch_tls_local_include_set()
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch._C._EnableTorchFunction():
        yield


def _empty_weights(q: Tensor) -> Tensor:
    return q.new_empty(0)


@dataclass(frozen=True)
class EngineOp:
    """An engine's kernels as registered by ``define``."""

    name: str
    kernels: EngineKernels

    def run(self, q: Tensor, k: Tensor, v: Tensor, variant: Lowered, dropout_p: float,
            want_weights: bool) -> tuple[Tensor, Tensor, Tensor | None]:
        """out, lse and (when asked) weights on features q, k, v."""
        if torch.compiler.is_compiling():
            # Set once torch._dynamo loaded (``_WhenDynamoLoads``); else made here, for real.
            traced = _traced or _mark_nonstrict()
            out, lse, weights = traced(self.name, q, k, v, floats_as_scalars(variant),
                                       dropout_p, want_weights)
            return out, lse, weights if want_weights else None
        if not torch.is_grad_enabled():  # inference: no graph to record, no leaves to find
            out, lse, weights, _ = self.kernels.forward(q, k, v, variant, dropout_p,
                                                        want_weights)
            return out, lse, weights
        leaves = pytree.tree_leaves(variant)
        return _Eager.apply(self.kernels, variant, dropout_p, want_weights, q, k, v, *leaves)


def define(name: str, kernels: EngineKernels) -> EngineOp:
    """Register ``qkv::<name>_forward`` and ``qkv::<name>_backward`` with their shapes and
    autograd."""

    @torch.library.custom_op(f"qkv::{name}_forward", mutates_args=())
    def forward(q: Tensor, k: Tensor, v: Tensor, leaves: list[Tensor], key: str,
                dropout_p: float, want_weights: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        variant = _rebuild(leaves, key)
        with _as_in_eager(), torch.no_grad():
            out, lse, weights, seed = kernels.forward(q, k, v, variant, dropout_p, want_weights)
        weights = _empty_weights(q) if weights is None else weights.contiguous()
        return out.contiguous(), lse.contiguous(), weights, torch.tensor(seed)

    @forward.register_fake
    def _(q, k, v, leaves, key, dropout_p, want_weights):
        b, h, nq, _ = q.shape
        out = q.new_empty(b, h, nq, v.shape[-1])
        weights = q.new_empty(b, h, nq, k.shape[2]) if want_weights else _empty_weights(q)
        return out, kernels.lse_like(q), weights, torch.empty((), dtype=torch.int64)

    @torch.library.custom_op(f"qkv::{name}_backward", mutates_args=())
    def backward(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
                 out: Tensor, lse: Tensor, seed: Tensor, leaves: list[Tensor], key: str,
                 dropout_p: float, leaf_grads: list[bool]
                 ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        fresh = [t.detach().requires_grad_() if need else t
                 for t, need in zip(leaves, leaf_grads, strict=True)]
        variant = _rebuild(fresh, key)
        wanted = [t for t, need in zip(fresh, leaf_grads, strict=True) if need]
        with _as_in_eager():
            dq, dk, dv, grads = kernels.backward(dout, dlse, q, k, v, out, lse, int(seed),
                                                 variant, dropout_p, wanted)
        found = iter(grads)
        dleaves = []
        for t, need in zip(leaves, leaf_grads, strict=True):
            grad = next(found) if need else None
            dleaves.append(t.new_zeros(t.shape) if grad is None
                           else grad.to(t.dtype).contiguous())
        # Contiguous, as the shapes registered below say: a compiled graph views them.
        return dq.contiguous(), dk.contiguous(), dv.contiguous(), dleaves

    @backward.register_fake
    def _(dout, dlse, q, k, v, out, lse, seed, leaves, key, dropout_p, leaf_grads):
        return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
                [t.new_empty(t.shape) for t in leaves])

    def setup_context(ctx, inputs, output):
        q, k, v, leaves, key, dropout_p, _ = inputs
        out, lse, _, seed = output
        ctx.save_for_backward(q, k, v, out, lse, seed, *leaves)
        ctx.key, ctx.dropout_p = key, dropout_p
        ctx.leaf_grads = [t.requires_grad and t.is_floating_point() for t in leaves]

    def differentiate(ctx, dout, dlse, _dweights, _dseed):
        q, k, v, out, lse, seed, *leaves = ctx.saved_tensors
        dq, dk, dv, dleaves = backward(dout, dlse, q, k, v, out, lse, seed, leaves, ctx.key,
                                       ctx.dropout_p, ctx.leaf_grads)
        dleaves = [g if need else None for g, need in zip(dleaves, ctx.leaf_grads, strict=True)]
        return dq, dk, dv, dleaves, None, None, None

    forward.register_autograd(differentiate, setup_context=setup_context)
    _OPS[name] = forward
    return EngineOp(name, kernels)


class _Eager(torch.autograd.Function):
    """The same kernels in eager mode, with the variant's own tensors as its inputs."""

    @staticmethod
    def forward(ctx, kernels, variant, dropout_p, want_weights, q, k, v, *leaves):
        with torch.no_grad():
            out, lse, weights, seed = kernels.forward(q, k, v, variant, dropout_p, want_weights)
        ctx.kernels, ctx.variant, ctx.dropout_p, ctx.seed = kernels, variant, dropout_p, seed
        ctx.leaves = leaves
        ctx.save_for_backward(q, k, v, out, lse)
        if weights is not None:
            ctx.mark_non_differentiable(weights)
        return out, lse, weights

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse, _dweights):
        q, k, v, out, lse = ctx.saved_tensors
        # A tensor the variant reads twice is one input with one gradient.
        wanted = list({id(t): t for t in ctx.leaves
                       if t.requires_grad and t.is_floating_point()}.values())
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv, grads = ctx.kernels.backward(dout, dlse, q, k, v, out, lse, ctx.seed,
                                                 ctx.variant, ctx.dropout_p, wanted)
        by_id = {id(t): g for t, g in zip(wanted, grads, strict=True)}
        return (None, None, None, None, dq, dk, dv,
                *(by_id.pop(id(t), None) for t in ctx.leaves))


def _traced_call(name: str, q: Tensor, k: Tensor, v: Tensor, variant: Lowered,
                 dropout_p: float, want_weights: bool):
    """Runs for real (on fake tensors) while torch.compile or torch.export traces: the
    variant's structure enters the registry, and the graph holds the op with its key."""
    leaves, spec = pytree.tree_flatten(variant)
    out, lse, weights, _ = _OPS[name](q, k, v, leaves, _key(spec), dropout_p, want_weights)
    return out, lse, weights


# ``_traced_call`` behind ``torch._dynamo.nonstrict_trace``, made as soon as torch._dynamo is
# imported, not by importing it here: that import takes seconds (half of a `qkv` command's
# start-up), and nothing is traced before torch.compile or torch.export has imported it.
_traced: Callable | None = None


def _mark_nonstrict() -> Callable:
    global _traced
    if _traced is None:
        _traced = torch._dynamo.nonstrict_trace(_traced_call)
    return _traced


class _WhenDynamoLoads(importlib.abc.MetaPathFinder):
    """Calls ``_mark_nonstrict`` once torch._dynamo has been executed, whoever imports it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _mark_nonstrict()

        spec.loader.exec_module = exec_module
        return spec


if "torch._dynamo" in sys.modules:
    _mark_nonstrict()
else:
    sys.meta_path.insert(0, _WhenDynamoLoads())
