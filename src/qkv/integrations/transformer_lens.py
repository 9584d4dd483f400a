"""qkv inside TransformerLens: a ``TransformerBridge`` whose attention runs on qkv, hooks intact.

TransformerLens's bridge wraps a transformers model and switches it to eager attention so that
its hooks see the weights. ``enable(bridge)`` switches it to qkv instead::

    from transformer_lens.model_bridge import TransformerBridge
    from qkv.integrations.transformer_lens import enable
    bridge = enable(TransformerBridge.boot_transformers(name, hf_model=model))
    logits, cache = bridge.run_with_cache(tokens, names_filter="blocks.3.attn.hook_pattern")

The seam is the bridge's own: ``AttentionBridge.forward`` passes ``pattern_fn=hook_pattern`` to
a wrapped module marked ``accepts_pattern_fn``, and the module hands its keyword arguments on
to the attention function. There, a layer whose ``hook_pattern`` (or ``hook_attn_scores``,
which the bridge fires on the returned weights) has a hook forms its weights, runs the hook,
and multiplies what the hook returns by v, exactly; every other layer runs qkv's fused path
and forms no (B, H, N, N) tensor. What the seam cannot give is in docs/interp.md.

Needs transformer-lens (``pip install qkv[transformer-lens]``) and transformers.
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
from torch import Tensor
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.generalized_components.attention import AttentionBridge
from transformer_lens.model_bridge.generalized_components.position_embeddings_attention import (
    PositionEmbeddingsAttentionBridge,
)

from .transformers import attention_forward, register_forward
from .transformers.masks import Prepared

__all__ = ["attention_forward_hooked", "boot_transformers", "enable", "register"]

# The attribute of a wrapped attention module that holds its bridge's hook_attn_scores, which
# the bridge fires on the weights the module returns (eager returns them always; qkv only
# when that hook is on). An attribute of the module, not a table beside it: torch.compile
# reads an attribute of a module it traces, where a weak table's keys would be guarded on.
_SCORES_HOOK = "_qkv_scores_hook"


def register(name: str = "qkv", **attention_kwargs) -> str:
    """Register qkv's hook-aware attention and its mask function under ``name`` in transformers.

    Args:
        name: the ``attn_implementation`` the bridged model takes.
        attention_kwargs: a variant on top of the model's attention, as
            ``qkv.integrations.transformers.register`` takes it.

    Returns:
        ``name``.
    """
    return register_forward(attention_forward_hooked, name, attention_kwargs)


class _WhenImplementation:
    """``accepts_pattern_fn`` that holds while the module's model runs ``name``: switched back
    to eager, the bridge fires ``hook_pattern`` on the returned weights again, as it does
    for any module without the seam."""

    def __init__(self, module: torch.nn.Module, name: str):
        self.module, self.name = weakref.ref(module), name

    def __bool__(self) -> bool:
        module = self.module()
        config = getattr(module, "config", None)
        return getattr(config, "_attn_implementation", None) == self.name


def enable(bridge, name: str = "qkv", **attention_kwargs):
    """Run ``bridge``'s attention on qkv: registers ``name``, sets it as the wrapped model's
    attention implementation and opens the pattern seam of each attention module.

    Args:
        bridge: a TransformerLens ``TransformerBridge`` over a transformers model.
        name: the implementation name to register and select.
        attention_kwargs: a variant of qkv's attention (similarity, score_mod, ...).

    Returns:
        ``bridge``, changed in place.
    """
    model = getattr(bridge, "original_model", None)
    if not hasattr(model, "set_attn_implementation"):
        got = type(bridge).__name__ if model is None else f"one over {type(model).__name__}"
        raise TypeError(f"enable: bridge must be a TransformerBridge over a transformers model; "
                        f"got {got}")
    register(name, **attention_kwargs)
    model.set_attn_implementation(name)
    for component in bridge.modules():
        if not isinstance(component, AttentionBridge):
            continue
        module = getattr(component, "original_component", None)
        if module is None or type(module).__module__.startswith("transformer_lens"):
            continue  # bridges over TransformerLens's own modules compute attention themselves
        seam = _passes_kwargs(module)
        if seam:
            module.accepts_pattern_fn = _WhenImplementation(module, name)
            # past nn.Module's __setattr__: the hook stays the bridge's, not a submodule
            object.__setattr__(module, _SCORES_HOOK, component.hook_attn_scores)
        forward = type(component).forward
        if forward is not AttentionBridge.forward:
            delegates = seam and forward is _RECONSTRUCTING
            # The bridge's __setattr__ passes unknown names on to the wrapped module.
            object.__setattr__(component, "forward", functools.partial(
                _delegating_forward if delegates else _dense_mask_forward, component, name))
    return bridge


def _delegating_forward(component, name: str, *args, **kwargs):
    """A reconstructing bridge's forward (``PositionEmbeddingsAttentionBridge``: LLaMA, Qwen,
    Gemma, ...), which computes the scores itself in torch, made to delegate to the wrapped
    module, and so to qkv. A hook that only the reconstruction fires (pre-softmax
    ``hook_attn_scores``, ``hook_rot_q``/``hook_rot_k``, the rotary and per-head input hooks)
    or a per-head option of its config runs that layer on the reconstruction instead."""
    config = getattr(component.original_component, "config", None)
    reconstruct = getattr(config, "_attn_implementation", None) != name or any(
        bool(getattr(component.config, flag, False))
        for flag in ("use_split_qkv_input", "use_attn_in", "use_attn_result")) or any(
        _hooked(child) for child_name, child in component.named_children()
        if child_name.startswith("hook_") and child_name not in _DELEGATED_HOOKS)
    if not reconstruct:
        return AttentionBridge.forward(component, *args, **kwargs)
    return _dense_mask_forward(component, name, *args, **kwargs)


def _dense_mask_forward(component, name: str, *args, **kwargs):
    """The bridge's own forward, given qkv's mask as the dense (B, 1, Nq, Nk) bool tensor
    (True = may attend) that its reconstruction reads in place of eager's."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, Prepared):
        batch, heads, nq, nk = mask.shape
        device = next(component.original_component.parameters()).device
        kwargs["attention_mask"] = mask.mask.materialize(batch, heads, nq, nk, device=device)
    return type(component).forward(component, *args, **kwargs)


# The reconstruction that delegates to the wrapped module when no hook needs it: the same
# projections (q, k, v and o, which fire hook_q, hook_k, hook_v and hook_z either way), RoPE,
# norms and gates as the module computes them. Other reconstructions (GPT-2's joint QKV, whose
# module reads the unsplit projection) keep their own eager attention on qkv's masks.
_RECONSTRUCTING = PositionEmbeddingsAttentionBridge.forward

# The hooks a delegating forward fires too: around the wrapped module, and the pattern seam.
_DELEGATED_HOOKS = ("hook_in", "hook_out", "hook_pattern")


def boot_transformers(*args, name: str = "qkv", **kwargs):
    """``TransformerBridge.boot_transformers(*args, **kwargs)``, then ``enable(bridge, name)``."""
    return enable(TransformerBridge.boot_transformers(*args, **kwargs), name)


def _passes_kwargs(module: torch.nn.Module) -> bool:
    """Whether the module's forward takes ``**kwargs`` (and so hands them to attention)."""
    params = inspect.signature(module.forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _hooked(point) -> bool:
    """Whether a TransformerLens ``HookPoint`` has a forward or backward hook."""
    return point is not None and bool(point._forward_hooks or point._forward_pre_hooks
                                      or point._backward_hooks)


def attention_forward_hooked(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                             attention_mask, *, pattern_fn=None, dropout: float = 0.0,
                             variant: dict | None = None, **kwargs):
    """transformers' attention function with TransformerLens's pattern seam.

    Args:
        module: the attention layer.
        query: (B, H, Nq, D); key, value: (B, Hkv, Nk, D).
        attention_mask: as ``qkv.integrations.transformers.attention_forward`` takes it.
        pattern_fn: the bridge's ``hook_pattern``, called on the weights (B, H, Nq, Nk) when it
            (or the layer's ``hook_attn_scores``) has a hook; what it returns multiplies v.
            Given and without a hook, the layer forms no weights, ``output_attentions`` or not.
        dropout: dropout on the weights, applied after the hook.
        variant: ``register``'s attention_kwargs.
        kwargs: the rest of transformers' arguments (scaling, sliding_window, ...).

    Returns:
        (out (B, Nq, H, Dv), weights (B, H, Nq, Nk) as the hook left them, or None).
    """
    if not (_hooked(pattern_fn) or _hooked(getattr(module, _SCORES_HOOK, None))):
        if pattern_fn is not None:
            # The bridge's run_with_cache asks every layer for its weights, for eager's
            # hooks after the fact; through the seam a layer's hooks get them when hooked.
            kwargs["output_attentions"] = False
        return attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                 variant=variant, **kwargs)
    kwargs["output_attentions"] = True
    out, weights = attention_forward(module, query, key, value, attention_mask, variant=variant,
                                     **kwargs)
    pattern = weights if pattern_fn is None else pattern_fn(weights)
    if not isinstance(pattern, Tensor) or pattern.shape != weights.shape:
        raise ValueError(f"hook_pattern must return a tensor of shape {tuple(weights.shape)}; "
                         f"got {getattr(pattern, 'shape', type(pattern).__name__)}")
    return _output(out, weights, pattern, value, dropout), pattern


def _output(out: Tensor, weights: Tensor, pattern: Tensor, value: Tensor,
            dropout: float) -> Tensor:
    """The layer's output (B, Nq, H, Dv) from the pattern the hook returned (B, H, Nq, Nk).

    A pattern left as it was keeps the fused output's values, bit for bit, and takes the
    gradient of pattern @ v, so that the pattern's gradient (attention × gradient) and the
    gradients through it to q and k are those of the eager product."""
    if pattern is weights and dropout == 0.0 and not (torch.is_grad_enabled()
                                                      and pattern.requires_grad):
        return out
    if dropout > 0.0:
        pattern = torch.nn.functional.dropout(pattern, dropout, training=True)
    heads, kv_heads = pattern.shape[1], value.shape[1]
    v = value.repeat_interleave(heads // kv_heads, dim=1) if heads != kv_heads else value
    product = (pattern.to(v.dtype) @ v).transpose(1, 2)
    if pattern is weights and dropout == 0.0:
        return out.detach() + (product - product.detach())
    return product.contiguous()
