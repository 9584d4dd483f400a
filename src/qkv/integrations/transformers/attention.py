"""The attention function transformers calls in every layer, computed by ``qkv.attention``."""

from __future__ import annotations

import torch
from torch import Tensor

from ...core import api, scores
from ...core import masks as qm
from .masks import Unmasked

# Keyword arguments that reach the attention function but do not change attention: outputs
# other modules record, positions already applied to q and k (RoPE), the loss's token count.
_INERT = {"position_ids", "output_hidden_states", "output_router_logits", "num_items_in_batch",
          "use_cache", "cache_position", "return_dict"}

# What ``register(**attention_kwargs)`` may set: the variant, on top of the model's own.
VARIANT_KEYS = ("similarity", "score_mod", "mask", "scale", "metric", "backend")


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask, *, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, sliding_window: int | None = None,
                      s_aux: Tensor | None = None, is_causal: bool | None = None,
                      output_attentions: bool | None = None, head_mask=None,
                      variant: dict | None = None, **kwargs):
    """transformers' ``AttentionInterface`` function, as the model's eager attention computes it.

    Args:
        module: the attention layer (read for ``is_causal`` and ``config.output_attentions``).
        query: (B, H, Nq, D); key, value: (B, Hkv, Nk, D), H a multiple of Hkv.
        attention_mask: what qkv's mask function built (a qkv mask), a bool tensor
            broadcastable to (B, H, Nq, Nk), or None (then ``is_causal`` or
            ``module.is_causal`` decides, as in transformers' SDPA function).
        dropout: dropout on the weights (the model passes 0 in eval).
        scaling: multiplies q·k (default 1/√D).
        softcap: Gemma 2's cap·tanh(score/cap), after scaling.
        sliding_window: a window (left reach w - 1) applied only when the mask was not built by
            qkv's mask function (which already holds it, from the same config).
        s_aux: (H,) learned sinks (GPT-OSS): one logit per head in each softmax denominator.
        output_attentions: also return the weights (B, H, Nq, Nk), from the fused path.
        variant: ``register``'s attention_kwargs: similarity, score_mod, extra mask, ...

    Returns:
        (out (B, Nq, H, Dv), weights (B, H, Nq, Nk) or None).
    """
    if head_mask is not None:
        raise ValueError("qkv attention: head_mask is not supported; expected None")
    # An argument passed as None asks for nothing (BERT's self-attention passes
    # encoder_hidden_states=None).
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k not in _INERT)
    if unknown:
        raise TypeError(f"qkv attention: unsupported argument {unknown[0]!r}")
    variant = dict(variant or {})
    mask = _mask(module, attention_mask, sliding_window, is_causal)
    extra = variant.pop("mask", None)
    if extra is not None:
        mask = extra if mask is None else mask & extra
    mods = [variant.pop("score_mod", None), None if softcap is None else scores.softcap(softcap)]
    mods = [m for m in mods if m is not None]
    if output_attentions is None:
        output_attentions = getattr(getattr(module, "config", None), "output_attentions", False)
    result = api.attention(
        query, key, value, mask=mask, score_mod=mods or None,
        scale=variant.pop("scale", scaling), dropout_p=dropout,
        return_weights=bool(output_attentions), sinks=s_aux, **variant)
    out, weights = result if output_attentions else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _mask(module, attention_mask, sliding_window, is_causal):
    """The layer's qkv mask, or None for full attention."""
    if isinstance(attention_mask, Unmasked):
        return None
    if isinstance(attention_mask, qm.Mask):
        return attention_mask
    if isinstance(attention_mask, Tensor):
        if attention_mask.dtype != torch.bool:
            raise ValueError(
                "qkv attention: attention_mask must be a qkv mask or a bool tensor; got a "
                f"{attention_mask.dtype} tensor (an additive 4-D mask)")
        return qm.as_mask(attention_mask)
    if attention_mask is not None:
        raise TypeError(
            f"qkv attention: unsupported attention_mask of type {type(attention_mask).__name__}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window is None:
        return qm.causal() if causal else None
    if not causal:
        raise ValueError("qkv attention: sliding_window without a mask needs causal attention; "
                         "got is_causal=False")
    return qm.sliding_window(sliding_window - 1)
