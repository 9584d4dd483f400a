"""Ablation, activation patching, attention × gradient and the logit lens, as hooks.

Layers are numbered over the model's self-attention blocks in model order (GPT's, the
Encoder's and ViT's ``blocks.{l}``); every function takes a model with the hook methods of
``qkv.nn.hooks.HookedModel`` and passes ``**kwargs`` on to its forward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..nn.hooks import HookedModel, hook_sites

Metric = Callable[[Tensor], Tensor]
WHATS = ("z", "pattern", "resid")


def _names(model: nn.Module, short: str) -> list[str]:
    """The self-attention (``.attn.``) or block names ending in ``short``, by layer."""
    if not isinstance(model, HookedModel):
        raise TypeError(f"model must be a qkv model with hooks (GPT, Encoder, Transformer, "
                        f"ViT); got {type(model).__name__}")
    found = [n for n in hook_sites(model) if n.endswith(f".{short}")
             and (short.startswith("hook_resid") or n.endswith(f".attn.{short}"))]
    if not found:
        raise ValueError(f"{type(model).__name__} has no {short} hooks")
    return found


def _layer(names: list[str], layer: int) -> str:
    if isinstance(layer, bool) or not isinstance(layer, int) or not -len(names) <= layer < \
            len(names):
        raise ValueError(f"layer must be an int in 0..{len(names) - 1}; got {layer!r}")
    return names[layer]


@contextlib.contextmanager
def ablate(model: nn.Module, heads: Sequence[tuple[int, int]],
           mode: str = "zero") -> Iterator[None]:
    """Inside the block, each (layer, head) of ``heads`` outputs zeros (``mode="zero"``) or
    its own output's mean over positions (``mode="mean"``, per batch row) as its ``hook_z``
    (B, N, H, Dv) slice; the other heads and layers run as usual."""
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean'; got {mode!r}")
    names = _names(model, "hook_z")
    by_name: dict[str, list[int]] = {}
    for entry in heads:
        if len(entry) != 2:
            raise ValueError(f"heads must hold (layer, head) pairs; got {entry!r}")
        by_name.setdefault(_layer(names, entry[0]), []).append(entry[1])

    def hook(chosen: list[int]):
        def fn(z: Tensor, point) -> Tensor:
            bad = [h for h in chosen if not 0 <= h < z.shape[2]]
            if bad:
                raise ValueError(f"heads {bad} are out of range for {point.name}: valid heads "
                                 f"are 0..{z.shape[2] - 1}")
            z = z.clone()
            index = torch.tensor(chosen, device=z.device)
            part = z[:, :, index]
            z[:, :, index] = torch.zeros_like(part) if mode == "zero" else \
                part.mean(1, keepdim=True).expand_as(part)
            return z
        return fn

    with model.hooks([(name, hook(chosen)) for name, chosen in by_name.items()]):
        yield


def _scalar(metric: Metric, logits: Tensor) -> float:
    value = metric(logits)
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise ValueError("metric must map logits to a one-element tensor")
    return float(value)


def patch(model: nn.Module, clean_idx: Tensor, corrupted_idx: Tensor, *, what: str = "z",
          metric: Metric, layers: Sequence[int] | None = None, **kwargs) -> Tensor:
    """Activation patching, as TransformerLens's ``patching`` module does it: each entry is
    ``metric(logits)`` of the corrupted run with one piece taken from the clean run.

    Args:
        clean_idx, corrupted_idx: (B, N) inputs of the same shape.
        what: "z": one head's ``hook_z``; "pattern": one head's ``hook_pattern`` (the
            layer's output becomes that pattern @ v for the head); "resid": one position of
            ``hook_resid_pre``.
        metric: logits -> a one-element tensor.
        layers: the layers to patch, in this order (None: all).

    Returns:
        (layers, heads) for "z" and "pattern", (layers, positions) for "resid", float64.
    """
    if what not in WHATS:
        raise ValueError(f"what must be one of {WHATS}; got {what!r}")
    if clean_idx.shape != corrupted_idx.shape:
        raise ValueError(f"clean_idx and corrupted_idx must have one shape; got "
                         f"{tuple(clean_idx.shape)} and {tuple(corrupted_idx.shape)}")
    short = {"z": "hook_z", "pattern": "hook_pattern", "resid": "hook_resid_pre"}[what]
    names = _names(model, short)
    names = names if layers is None else [_layer(names, layer) for layer in layers]
    with torch.no_grad():
        if what == "pattern":
            return _patch_patterns(model, names, clean_idx, corrupted_idx, metric, kwargs)
        _, clean = model.run_with_cache(clean_idx, names_filter=names, **kwargs)
        width = clean[names[0]].shape[2] if what == "z" else clean_idx.shape[1]
        grid = torch.zeros(len(names), width, dtype=torch.float64)
        for layer, name in enumerate(names):
            for i in range(width):
                def swap(t: Tensor, point, i=i, source=clean[name]) -> Tensor:
                    t = t.clone()
                    if what == "z":
                        t[:, :, i] = source[:, :, i]
                    else:
                        t[:, i] = source[:, i]
                    return t
                logits = model.run_with_hooks(corrupted_idx, fwd_hooks=[(name, swap)],
                                              **kwargs)
                grid[layer, i] = _scalar(metric, logits)
    return grid


def _patch_patterns(model, names, clean_idx, corrupted_idx, metric, kwargs) -> Tensor:
    """(layers, heads) of pattern patching, holding one layer's clean patterns at a time."""
    rows = []
    for name in names:
        _, clean = model.run_with_cache(clean_idx, names_filter=name, **kwargs)
        source = clean[name]
        row = []
        for head in range(source.shape[1]):
            def swap(w: Tensor, point, head=head, source=source) -> Tensor:
                return source[:, head:head + 1].to(w.dtype)
            logits = model.run_with_hooks(corrupted_idx, fwd_hooks=[(name, swap)],
                                          heads=[head], **kwargs)
            row.append(_scalar(metric, logits))
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float64)


def attribution(model: nn.Module, idx: Tensor, metric: Metric, *,
                layers: Sequence[int] | None = None, heads: Sequence[int] | None = None,
                rows: tuple[int, int] | None = None, **kwargs) -> Tensor:
    """Attention × gradient: each chosen layer's pattern times the gradient of
    ``metric(model(idx))`` with respect to it.

    Args:
        idx: the model's input (B, N).
        metric: logits -> a one-element tensor.
        layers: self-attention layers (None: all); heads, rows: the query heads and
            (start, stop) query rows whose patterns are formed (None: all).

    Returns:
        (layers, B, heads, rows, Nk); ``.sum((1, 3, 4))`` gives one score per layer and
        head.
    """
    names = _names(model, "hook_pattern")
    chosen = names if layers is None else [_layer(names, layer) for layer in layers]
    patterns: dict[str, Tensor] = {}

    def keep(w: Tensor, point) -> Tensor:
        # A pattern formed without a graph becomes a leaf; written back, the layer's output
        # is w @ v, so the metric's gradient reaches it either way.
        w = w if w.requires_grad else w.detach().requires_grad_()
        patterns[point.name] = w
        return w

    with torch.enable_grad(), model.hooks([(set(chosen).__contains__, keep)],
                                          heads=heads, rows=rows):
        value = metric(model(idx, **kwargs))
    if not isinstance(value, Tensor) or value.numel() != 1:
        raise ValueError("metric must map logits to a one-element tensor")
    found = [patterns[name] for name in chosen]
    grads = torch.autograd.grad(value.sum(), found, allow_unused=True)
    return torch.stack([(w * (torch.zeros_like(w) if g is None else g)).detach()
                        for w, g in zip(found, grads, strict=True)])


def logit_lens(model: nn.Module, idx: Tensor, *, positions=None, **kwargs) -> Tensor:
    """Each layer's ``hook_resid_post`` through the model's final norm and LM head.

    Args:
        idx: (B, N) token ids.
        positions: an index of dim 1 (an int, a list or a slice) to read the lens at;
            None: every position.

    Returns:
        (layers, B, P, V) logits (P: the positions read)."""
    if not (isinstance(getattr(model, "norm", None), nn.Module)
            and isinstance(getattr(model, "lm_head", None), nn.Module)):
        raise TypeError(f"logit_lens needs a language model with norm and lm_head (GPT); got "
                        f"{type(model).__name__}")
    names = _names(model, "hook_resid_post")
    where = slice(None) if positions is None else \
        [positions] if isinstance(positions, int) else positions
    with torch.no_grad():
        _, cache = model.run_with_cache(idx, names_filter=names, **kwargs)
        return torch.stack([model.lm_head(model.norm(cache[name][:, where]))
                            for name in names])
