"""The attention function transformers calls in every layer, computed by ``qkv.attention``."""

from __future__ import annotations

import torch
from torch import Tensor

from ...core import masks as qm
from ...core import scores, spellings
from ...engines import api
from .masks import Prepared, Unmasked, position_segments

# Keyword arguments of other layers' (T5's, ...) that change attention, which qkv cannot
# honour. transformers hands every forward's other keyword arguments (the loss's
# shift_labels, num_items_in_batch, ...) to the attention function, which ignores those it
# does not use, as SDPA's and eager's do.
_UNSUPPORTED = {"position_bias", "layer_head_mask"}

# What ``register(**attention_kwargs)`` may set: the variant, on top of the model's own.
VARIANT_KEYS = ("similarity", "score_mod", "mask", "scale", "metric", "backend", "weighting")


def attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask, *, dropout: float = 0.0, scaling: float | None = None,
                      softcap: float | None = None, sliding_window: int | None = None,
                      s_aux: Tensor | None = None, is_causal: bool | None = None,
                      output_attentions: bool | None = None, head_mask=None,
                      cu_seq_lens_q: Tensor | None = None, cu_seq_lens_k: Tensor | None = None,
                      position_ids: Tensor | None = None, variant: dict | None = None, **kwargs):
    """transformers' ``AttentionInterface`` function, as the model's eager attention computes it.

    Args:
        module: the attention layer (read for ``is_causal`` and ``config.output_attentions``).
        query: (B, H, Nq, D); key, value: (B, Hkv, Nk, D), H a multiple of Hkv.
        attention_mask: what qkv's mask function built (a qkv mask), a bool or additive float
            tensor broadcastable to (B, H, Nq, Nk) (a float one is added to the scores, as
            SDPA adds it), or None (then ``is_causal`` or ``module.is_causal`` decides, as in
            transformers' SDPA function).
        dropout: dropout on the weights (the model passes 0 in eval).
        scaling: multiplies q·k (default 1/√D).
        softcap: Gemma 2's cap·tanh(score/cap), after scaling.
        sliding_window: a window (left reach w - 1) applied only when the mask was not built by
            qkv's mask function (which already holds it, from the same config).
        s_aux: (H,) learned sinks (GPT-OSS): one logit per head in each softmax denominator.
        output_attentions: also return the weights (B, H, Nq, Nk), from the fused path.
        cu_seq_lens_q, cu_seq_lens_k: (S + 1,) cumulative lengths of S sequences packed into
            one row (``DataCollatorWithFlattening``): attention stays within each.
        position_ids: (1, N) positions of one row; where they restart, attention stays within
            each run (packed documents), unless the mask already keeps them apart, the
            lengths above give them, or the mask is the caller's own tensor.
        variant: ``register``'s attention_kwargs: similarity, score_mod, extra mask, ...

    Returns:
        (out (B, Nq, H, Dv), weights (B, H, Nq, Nk) or None).
    """
    if head_mask is not None:
        raise ValueError("qkv attention: head_mask is not supported; expected None")
    # An argument passed as None asks for nothing (BERT's self-attention passes
    # encoder_hidden_states=None).
    unknown = sorted(k for k, v in kwargs.items() if v is not None and k in _UNSUPPORTED)
    if unknown:
        raise TypeError(f"qkv attention: unsupported argument {unknown[0]!r}")
    variant = dict(variant or {})
    mask, bias = _mask(module, attention_mask, sliding_window, is_causal, query, key)
    packed = _packed(cu_seq_lens_q, cu_seq_lens_k, query.shape, key.shape[2])
    # A tensor mask is the caller's whole layout; a prepared one may keep the documents apart.
    if packed is None and not isinstance(attention_mask, Tensor) and not (
            isinstance(attention_mask, Prepared) and attention_mask.packed):
        packed = position_segments(position_ids, query.shape[0], query.shape[2], key.shape[2])
    mask = spellings.combine([mask, packed, variant.pop("mask", None)])
    mods = [variant.pop("score_mod", None), None if softcap is None else scores.softcap(softcap),
            bias]
    mods = [m for m in mods if m is not None]
    if output_attentions is None:
        output_attentions = getattr(getattr(module, "config", None), "output_attentions", False)
    result = api.attention(
        query, key, value, mask=mask, score_mod=mods or None,
        scale=variant.pop("scale", scaling), dropout_p=dropout,
        return_weights=bool(output_attentions), sinks=s_aux, **variant)
    out, weights = result if output_attentions else (result, None)
    return out.transpose(1, 2).contiguous(), weights


def _mask(module, attention_mask, sliding_window, is_causal, query, key):
    """The layer's qkv mask (None for full attention) and additive bias (None, or a float
    mask's values)."""
    if isinstance(attention_mask, Prepared):
        attention_mask = attention_mask.mask
    if isinstance(attention_mask, Unmasked):
        return None, None
    if isinstance(attention_mask, qm.Mask):
        return attention_mask, None
    if isinstance(attention_mask, Tensor):
        shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
        return spellings.split_mask(attention_mask, "attention_mask", shape)
    if attention_mask is not None:
        raise TypeError(
            f"qkv attention: unsupported attention_mask of type {type(attention_mask).__name__}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if sliding_window is None:
        return (qm.causal() if causal else None), None
    if not causal:
        raise ValueError("qkv attention: sliding_window without a mask needs causal attention; "
                         "got is_causal=False")
    return qm.sliding_window(sliding_window - 1), None


def _packed(cu_q: Tensor | None, cu_k: Tensor | None, q_shape, nk: int) -> qm.Mask | None:
    """Segments from flash-attention's cumulative sequence lengths (one packed row)."""
    if cu_q is None and cu_k is None:
        return None
    if q_shape[0] != 1:
        raise ValueError(f"qkv attention: cu_seq_lens_q/k describe one packed row; the batch "
                         f"has {q_shape[0]}")
    nq = q_shape[2]
    cu_k = cu_q if cu_k is None else cu_k
    cu_q = cu_k if cu_q is None else cu_q
    ids = []
    for name, cu, n in (("cu_seq_lens_q", cu_q, nq), ("cu_seq_lens_k", cu_k, nk)):
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != n:
            raise ValueError(f"qkv attention: {name} must run from 0 to the packed row's "
                             f"length {n}; got {cu.tolist()}")
        ids.append(torch.searchsorted(cu[1:].to(torch.long),
                                      torch.arange(n, device=cu.device), right=True))
    return qm.segments(ids[0], ids[1])
