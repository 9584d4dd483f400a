"""qkv inside Hugging Face transformers: ``attn_implementation="qkv"``.

``register()`` adds qkv's attention function to transformers' ``AttentionInterface`` and its
mask function to ``AttentionMaskInterface`` under one name; any model that calls the attention
interface then runs on qkv's engines::

    from qkv.integrations.transformers import register
    register()                                        # "qkv": the model's own attention
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="qkv")
    register("qkv_l1", similarity="l1")               # a variant on top of the model's masks
    model.set_attn_implementation("qkv_l1")

Importing qkv registers nothing; this module needs transformers (``pip install qkv[transformers]``).
"""

from __future__ import annotations

import functools

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .attention import VARIANT_KEYS, attention_forward
from .masks import mask_function

__all__ = ["attention_forward", "mask_function", "register", "register_forward"]


def register(name: str = "qkv", **attention_kwargs) -> str:
    """Register qkv under ``name`` as an attention implementation of transformers.

    Args:
        name: the ``attn_implementation`` models will take.
        attention_kwargs: a variant of ``qkv.attention`` applied on top of each model's own
            attention: ``similarity`` (a name or ``qkv.Similarity``), ``score_mod`` (applied
            after the model's scaling, before its softcap), ``mask`` (a qkv mask intersected
            with the model's), ``scale`` (replaces the model's scaling), ``metric``, ``backend``.

    Returns:
        ``name``.
    """
    return register_forward(attention_forward, name, attention_kwargs)


def register_forward(forward, name: str, attention_kwargs: dict) -> str:
    """``register`` with the attention function ``forward(module, q, k, v, attention_mask,
    ..., variant=attention_kwargs)`` (``attention_forward``, or one that also takes
    TransformerLens's ``pattern_fn``) and qkv's mask function, under ``name``."""
    if not isinstance(name, str) or not name or name == "eager":
        raise ValueError(
            f"register: name must be a non-empty string other than 'eager'; got {name!r}")
    unknown = sorted(set(attention_kwargs) - set(VARIANT_KEYS))
    if unknown:
        raise TypeError(f"register: unsupported argument {unknown[0]!r}; expected one of "
                        f"{', '.join(VARIANT_KEYS)}")
    AttentionInterface.register(name, functools.partial(forward, variant=attention_kwargs))
    AttentionMaskInterface.register(name, mask_function)
    return name
