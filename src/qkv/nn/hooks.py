"""Hooks on any qkv model, named and shaped as TransformerLens names and shapes them.

    logits, cache = model.run_with_cache(idx, names_filter="blocks.3.attn.hook_pattern",
                                         heads=[0, 5])
    cache["blocks.3.attn.hook_pattern"]          # (B, 2, N, N): heads 0 and 5
    model.run_with_hooks(idx, fwd_hooks=[("blocks.3.attn.hook_z", fn)])
    with model.hooks([("blocks.3.hook_resid_post", fn)]):
        model(idx)

Each block at module path P (``blocks.3`` in GPT, the Encoder and ViT; ``encoder.3`` and
``decoder.3`` in the Transformer) has ``P.hook_resid_pre`` and ``P.hook_resid_post``
(B, N, d_model), and its multi-head attention layers ``P.attn`` (self-attention) and
``P.cross_attn`` have:

| name | shape | what |
| --- | --- | --- |
| ``hook_q`` | (B, Nq, H, D) | queries as attention sees them (after RoPE) |
| ``hook_k``, ``hook_v`` | (B, Nk, Hkv, D) | keys (after RoPE) and values, KV cache included |
| ``hook_attn_scores`` | (B, h, r, Nk) | scores before the weighting, -inf where masked |
| ``hook_pattern`` | (B, h, r, Nk) | the weights |
| ``hook_z`` | (B, Nq, H, Dv) | each head's output, before W^O |
| ``hook_result`` | (B, Nq, H, d_model) | each head's output through its slice of W^O, no bias |

(h, r: the ``heads`` and ``rows`` selection, all by default.) A hook is ``fn(tensor, hook)``
(``hook.name``, ``hook.layer()``); a returned tensor replaces the activation and the model
continues from it, None reads only. Hooks are installed for the call or the block alone, as
torch hooks on the modules and as a wrapper of ``MultiHeadAttention.attend`` (only where q,
k, v, scores or patterns are hooked), so layers nobody hooks run exactly as before.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from .attention import MultiHeadAttention
from .blocks import DecoderBlock, TransformerBlock
from .hooked_attention import AttentionHooks, HookPoint, run_hooks

ATTEND_HOOKS = ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern")
ATTENTION_HOOKS = (*ATTEND_HOOKS, "hook_z", "hook_result")
BLOCK_HOOKS = ("hook_resid_pre", "hook_resid_post")
HookFn = Callable[[Tensor, HookPoint], Tensor | None]


def hook_sites(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every hook name of ``model`` -> (the module it sits on, its short name), in model
    order."""
    sites: dict[str, tuple[nn.Module, str]] = {}
    for path, module in model.named_modules():
        if not path or not isinstance(module, (TransformerBlock, DecoderBlock)):
            continue
        sites[f"{path}.hook_resid_pre"] = (module, "hook_resid_pre")
        layers = (("attn", module.self_attn), ("cross_attn", getattr(module, "cross_attn", None)))
        for label, attn in layers:
            if isinstance(attn, MultiHeadAttention):
                for short in ATTENTION_HOOKS:
                    sites[f"{path}.{label}.{short}"] = (attn, short)
        sites[f"{path}.hook_resid_post"] = (module, "hook_resid_post")
    return sites


def matching(names: Sequence[str], name_or_filter) -> list[str]:
    """The names a hook's name, or its filter (a callable name -> bool), picks."""
    if callable(name_or_filter):
        return [n for n in names if name_or_filter(n)]
    if name_or_filter not in names:
        raise ValueError(f"no hook named {name_or_filter!r}; names look like "
                         f"{', '.join(list(names)[:3])} ... (model.hook_names())")
    return [name_or_filter]


def _check_selection(heads, rows) -> tuple[list[int] | None, tuple[int, int] | None]:
    if heads is not None:
        heads = [heads] if isinstance(heads, int) else list(heads)
        if not heads or any(isinstance(h, bool) or not isinstance(h, int) or h < 0
                            for h in heads):
            raise ValueError(f"heads must be None or non-negative head indices; got {heads}")
        heads = sorted(set(heads))
    if rows is not None:
        if len(rows) != 2 or any(not isinstance(r, int) for r in rows):
            raise ValueError(f"rows must be None or (start, stop) ints; got {rows!r}")
        rows = (rows[0], rows[1])
    return heads, rows


def _z_hook(name: str, fns: list, heads: int):
    def pre(module, args):
        flat = args[0]
        z, written = run_hooks(fns, flat.unflatten(-1, (heads, -1)), HookPoint(name))
        return (z.flatten(-2), *args[1:]) if written else None
    return pre


def _result_hook(name: str, fns: list, heads: int):
    def post(module, args, out):
        if not isinstance(getattr(module, "weight", None), Tensor):
            raise TypeError(f"{name} needs the output projection's weight; "
                            f"{type(module).__name__} keeps none (unpack it first)")
        z = args[0].unflatten(-1, (heads, -1))
        w = module.weight.unflatten(1, (heads, -1)).to(z.dtype)
        result, written = run_hooks(fns, torch.einsum("bnhd,mhd->bnhm", z, w),
                                    HookPoint(name))
        if not written:
            return None
        summed = result.sum(-2)
        return summed if module.bias is None else summed + module.bias
    return post


def _resid_hook(name: str, fns: list, pre: bool):
    if pre:
        def before(module, args):
            x, written = run_hooks(fns, args[0], HookPoint(name))
            return (x, *args[1:]) if written else None
        return before

    def after(module, args, out):
        x, written = run_hooks(fns, out, HookPoint(name))
        return x if written else None
    return after


@contextlib.contextmanager
def installed(model: nn.Module, fwd_hooks: Sequence[tuple], *, heads=None,
              rows=None) -> Iterator[None]:
    """Install ``fwd_hooks``, (name or filter, fn) pairs, for the block; ``heads`` and
    ``rows`` choose what scores and patterns are formed for (module docstring)."""
    heads, rows = _check_selection(heads, rows)
    sites = hook_sites(model)
    if not sites:
        raise ValueError(f"{type(model).__name__} has no Transformer blocks to hook")
    by_name: dict[str, list] = {}
    for entry in fwd_hooks:
        if len(entry) != 2 or not callable(entry[1]):
            raise ValueError(f"fwd_hooks entries must be (name or filter, fn); got {entry!r}")
        for name in matching(list(sites), entry[0]):
            by_name.setdefault(name, []).append(entry[1])
    handles, wrapped = [], []
    attend: dict[nn.Module, AttentionHooks] = {}
    try:
        for name, fns in by_name.items():
            module, short = sites[name]
            if short in ATTEND_HOOKS:
                prefix = name.rsplit(".", 1)[0]
                attend.setdefault(module, AttentionHooks(prefix, {}, heads, rows)) \
                    .fns[short] = fns
            elif short == "hook_z":
                handles.append(module.out_proj.register_forward_pre_hook(
                    _z_hook(name, fns, module.n_head)))
            elif short == "hook_result":
                handles.append(module.out_proj.register_forward_hook(
                    _result_hook(name, fns, module.n_head)))
            elif short == "hook_resid_pre":
                handles.append(module.register_forward_pre_hook(_resid_hook(name, fns, True)))
            else:
                handles.append(module.register_forward_hook(_resid_hook(name, fns, False)))
        for module, hooks in attend.items():
            if module.observed:
                raise RuntimeError(f"{hooks.prefix}.attend is wrapped already (qkv.viz "
                                   "capture or other hooks): leave that block first")
            module.attend = hooks.attend
            wrapped.append(module)
        yield
    finally:
        for handle in handles:
            handle.remove()
        for module in wrapped:
            del module.attend  # the class's own method again


def _every(name: str) -> bool:
    return True


class ActivationCache(dict):
    """Activations by hook name; ``cache["pattern", 3]`` is ``cache["blocks.3.attn.
    hook_pattern"]`` and ``cache["resid_post", 3]`` ``cache["blocks.3.hook_resid_post"]``,
    as in TransformerLens."""

    def __getitem__(self, key):
        if isinstance(key, tuple):
            short, layer = key
            short = short if short.startswith("hook_") else f"hook_{short}"
            where = "" if short in BLOCK_HOOKS else "attn."
            key = f"blocks.{layer}.{where}{short}"
        return super().__getitem__(key)


class HookedModel:
    """TransformerLens's hook methods for a model made of qkv blocks (mixed into GPT, the
    Encoder, the Transformer and ViT)."""

    def hook_names(self) -> list[str]:
        """Every hook name, in model order."""
        return list(hook_sites(self))

    def hooks(self, fwd_hooks: Sequence[tuple] = (), *, heads: Sequence[int] | None = None,
              rows: tuple[int, int] | None = None):
        """A context manager: ``fwd_hooks`` ((name or filter, fn) pairs) are installed inside
        it. ``heads``: the query heads scores and patterns are formed for (None: all);
        ``rows``: (start, stop), their query rows (None: all)."""
        return installed(self, fwd_hooks, heads=heads, rows=rows)

    def run_with_hooks(self, *args, fwd_hooks: Sequence[tuple] = (),
                       heads: Sequence[int] | None = None,
                       rows: tuple[int, int] | None = None, **kwargs):
        """The model's forward (args, kwargs) with ``fwd_hooks`` installed for the call."""
        with installed(self, fwd_hooks, heads=heads, rows=rows):
            return self(*args, **kwargs)

    def run_with_cache(self, *args, names_filter=None, heads: Sequence[int] | None = None,
                       rows: tuple[int, int] | None = None, **kwargs):
        """(the forward's output, ActivationCache) of the hooks ``names_filter`` picks: a
        name, a list of names, a callable name -> bool, or None for every hook (every
        layer's patterns are then formed, (B, H, N, N) each). Activations are detached."""
        cache = ActivationCache()

        def keep(tensor: Tensor, hook: HookPoint) -> None:
            cache[hook.name] = tensor.detach()

        if names_filter is None:
            chosen = _every
        elif isinstance(names_filter, str) or callable(names_filter):
            chosen = names_filter
        else:
            wanted = set(names_filter)
            unknown = wanted - set(hook_sites(self))
            if unknown:
                raise ValueError(f"names_filter names no hook of this model: {sorted(unknown)}")
            chosen = wanted.__contains__
        with installed(self, [(chosen, keep)], heads=heads, rows=rows):
            out = self(*args, **kwargs)
        return out, cache
