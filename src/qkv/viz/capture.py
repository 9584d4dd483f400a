"""``qkv.viz.capture``: attention maps of chosen layers and heads from a normal forward pass.

    with qkv.viz.capture(model, layers=[0, -1], heads=[0, 2]) as maps:
        model(idx)
    maps[-1]            # (B, 2, N, N): the last layer's heads 0 and 2

Attention layers are found by their module paths: a block's ``self_attn`` and
``cross_attn`` (``decoder.blocks.3.cross_attn`` is layer 3 of the stack ``decoder.blocks``,
cross-attention), or the model itself when it is one ``MultiHeadAttention``.

For the duration, each chosen layer's one call point, its ``attend``, is wrapped. The call
itself is unchanged (same engine, SDPA or fused, same outputs) and also hands back its
log-sum-exp; from it the wrapper recomputes the softmax rows of the chosen heads only, from
the q and k the layer computed and the same mask, score modifier, similarity and scale
(``qkv.viz.weights.head_weights``). No (Nq, Nk) tensor is formed or kept for heads nobody
asked for. A differential attention layer's head h is its difference map A_2h − λ A_2h+1,
from the two maps of its one fused call. Weights are those of eval mode: attention dropout,
if a training-mode call applies it, is not in them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..engines.api import attention_result
from ..nn.attention import MultiHeadAttention
from ..nn.differential import DifferentialAttention
from .weights import check_heads, head_weights


@dataclass
class CapturedMap:
    """The maps of one attention layer. ``calls`` holds one (B, len(heads), Nq, Nk) tensor per
    forward call (generation with a KV cache gives one per step)."""

    name: str
    stack: str
    layer: int
    is_cross: bool
    heads: list[int]
    calls: list[Tensor] = field(default_factory=list)

    @property
    def weights(self) -> Tensor:
        """The last call's weights (B, len(heads), Nq, Nk)."""
        if not self.calls:
            raise ValueError(f"{self.name}: nothing captured (run a forward pass inside capture)")
        return self.calls[-1]


@dataclass
class AttentionMaps:
    """Every captured layer, in model order."""

    sites: list[CapturedMap]

    def __iter__(self) -> Iterator[CapturedMap]:
        return iter(self.sites)

    def __len__(self) -> int:
        return len(self.sites)

    def stacks(self) -> list[str]:
        return list(dict.fromkeys(s.stack for s in self.sites))

    def select(self, *, stack: str | None = None, cross: bool = False) -> list[CapturedMap]:
        """The captured layers of one stack (self- or cross-attention), by layer index."""
        found = [s for s in self.sites if s.is_cross == cross
                 and (stack is None or s.stack == stack)]
        stacks = list(dict.fromkeys(s.stack for s in found))
        kind = "cross-attention" if cross else "self-attention"
        if not found:
            raise ValueError(f"no captured {kind} layers" +
                             (f" in stack {stack!r}" if stack else "") + f"; stacks: "
                             f"{self.stacks()}")
        if len(stacks) > 1:
            raise ValueError(f"the {kind} layers come from several stacks {stacks}; pass stack=")
        return sorted(found, key=lambda s: s.layer)

    def get(self, layer: int, *, stack: str | None = None, cross: bool = False) -> CapturedMap:
        chosen = self.select(stack=stack, cross=cross)
        layers = [s.layer for s in chosen]
        if layer < 0:
            layer = max(layers) + 1 + layer
        for s in chosen:
            if s.layer == layer:
                return s
        raise ValueError(f"layer {layer} was not captured; captured layers: {layers}")

    def __getitem__(self, layer: int) -> Tensor:
        """The last call's weights (B, len(heads), Nq, Nk) of self-attention layer ``layer``
        (the model must have one self-attention stack; else use ``get``)."""
        return self.get(layer).weights


def stack_name(name: str) -> str:
    """'decoder.blocks.3.cross_attn' -> 'decoder.blocks': the path up to the layer number."""
    parts = name.split(".")
    numbers = [i for i, part in enumerate(parts) if part.isdigit()]
    return ".".join(parts[: numbers[-1]]) if numbers else ".".join(parts[:-1])


ATTENTION_NAMES = ("self_attn", "cross_attn")


def attention_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every attention layer of the model, by module path: modules named ``self_attn`` or
    ``cross_attn``, or the model itself when it is a ``MultiHeadAttention``."""
    return [(name, m) for name, m in model.named_modules()
            if name.rsplit(".", 1)[-1] in ATTENTION_NAMES
            or (not name and isinstance(m, MultiHeadAttention))]


def is_cross_attention(name: str) -> bool:
    return name.rsplit(".", 1)[-1] == "cross_attn"


def layer_number(name: str) -> int | None:
    """'decoder.blocks.3.cross_attn' -> 3: the last number in the path, or None."""
    numbers = [int(part) for part in name.split(".") if part.isdigit()]
    return numbers[-1] if numbers else None


def _check_layers(layers, count: int, stack: str) -> set[int]:
    if layers is None:
        return set(range(count))
    chosen = [layers] if isinstance(layers, int) else list(layers)
    if not chosen:
        raise ValueError("layers must name at least one layer")
    picked = set()
    for layer in chosen:
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer indices must be ints; got {layer!r}")
        if not -count <= layer < count:
            raise ValueError(
                f"layer index {layer} is out of range for {stack}: valid layers are "
                f"0..{count - 1} (or -{count}..-1)"
            )
        picked.add(layer % count)
    return picked


def _check_no_weights(name: str, module: nn.Module) -> None:
    if not isinstance(module, (MultiHeadAttention, DifferentialAttention)):
        raise ValueError(
            f"{name} is {type(module).__name__}, an attention kind with no attention weights "
            "(linear attention and retention never form a softmax over keys), so there are no "
            "maps to capture; capture works on multi-head and differential attention"
        )


def _plan(model, layers, heads, stacks, cross) -> list[tuple[nn.Module, CapturedMap]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module; got {type(model).__name__}")
    found = attention_layers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention layers (modules named "
                         f"{' or '.join(ATTENTION_NAMES)})")
    # A decoder stack holds self- and cross-attention layers: group by both.
    groups: dict[tuple[str, bool], list[tuple[str, nn.Module]]] = {}
    for name, module in found:
        if cross is None or is_cross_attention(name) == cross:
            key = (stack_name(name), is_cross_attention(name))
            groups.setdefault(key, []).append((name, module))
    if stacks is not None:
        wanted = [stacks] if isinstance(stacks, str) else list(stacks)
        known = sorted({stack for stack, _ in groups})
        unknown = [s for s in wanted if s not in known]
        if unknown:
            raise ValueError(f"unknown stacks {unknown}; this model has {known}")
        groups = {key: members for key, members in groups.items() if key[0] in wanted}
    if not groups:
        raise ValueError(f"no attention layers match cross={cross}")
    plan = []
    for (stack, is_cross), members in groups.items():
        kind = "cross-attention" if is_cross else "self-attention"
        picked = _check_layers(layers, len(members), f"{stack} {kind}")
        for position, (name, module) in enumerate(members):
            number = layer_number(name)
            layer = number if number is not None else position
            if layer not in picked:
                continue
            _check_no_weights(name, module)
            chosen = check_heads(heads, module.n_head, name)
            plan.append((module, CapturedMap(name, stack, layer, is_cross, chosen)))
    return plan


@dataclass
class ObservedCall:
    """What a layer handed its observer on one forward call: q (B, H, Nq, D) and k
    (B, Hkv, Nk, D) as the engine saw them (after RoPE and the KV cache), mask, score_mod;
    ``first_row``: where the weights handed with it start among q's Nq rows (a long call's
    weights come a block of rows at a time, see ``capture``'s ``row_bytes``)."""

    module: nn.Module
    q: Tensor
    k: Tensor
    mask: object
    score_mod: object
    first_row: int = 0


OnWeights = Callable[[CapturedMap, Tensor, ObservedCall], None]


def _observer(site: CapturedMap, on_weights: OnWeights | None, row_bytes: int | None):
    # ``lse``: the engine's saved log-sum-exp (None from SDPA); with it the chosen heads'
    # weights are exp(score - lse), with no row reduction.
    def observe(module, q: Tensor, k: Tensor, lse: Tensor | None, kwargs: dict) -> None:
        q, k = q.detach(), k.detach()
        lse = None if lse is None else lse.detach()
        mask, score_mod = kwargs.get("mask"), kwargs.get("score_mod")
        nq, nk = q.shape[2], k.shape[2]
        # Streaming: at most row_bytes of float32 weights at once (per batch row).
        block = nq if on_weights is None or row_bytes is None else \
            max(1, row_bytes // (4 * len(site.heads) * nk))
        metric = kwargs.get("metric")
        paired = isinstance(module, DifferentialAttention)
        # A differential head h is the pair of query heads (2h, 2h+1) of the call.
        heads = [2 * h + i for h in site.heads for i in (0, 1)] if paired else site.heads
        with torch.no_grad():
            for start in range(0, nq, block):
                weights = head_weights(
                    q, k, heads, mask=mask, score_mod=score_mod,
                    similarity=kwargs.get("similarity", "dot"), scale=kwargs.get("scale"),
                    metric=None if metric is None else metric.detach(), lse=lse,
                    rows=(start, min(nq, start + block)),
                    weighting=kwargs.get("weighting", "softmax"),
                )
                if paired:
                    weights = difference_map(module, weights)
                if on_weights is None:
                    site.calls.append(weights)
                else:
                    on_weights(site, weights, ObservedCall(module, q, k, mask, score_mod, start))
    return observe


def difference_map(module: DifferentialAttention, weights: Tensor) -> Tensor:
    """(B, 2h, Nq, Nk) maps of query heads 2h and 2h+1, interleaved -> (B, h, Nq, Nk)
    A_2h − λ A_2h+1, the map a differential head applies to its values (rows may hold
    negative weights and sum to 1 − λ)."""
    lam = module.lambda_full().detach().to(weights.dtype)
    return weights[:, 0::2] - lam * weights[:, 1::2]


# The observers of each wrapped layer; a layer is wrapped while it has any (nested captures).
_OBSERVERS: dict[nn.Module, list] = {}


def _wrapped_attend(module: nn.Module, observers: list):
    """The layer's ``attend`` while captured: the same call, whose saved log-sum-exp lets each
    observer rebuild its heads' weights without another pass over the keys."""
    def attend(q: Tensor, k: Tensor, v: Tensor, **kwargs):
        result = attention_result(q, k, v, **kwargs)
        for observe in observers:
            observe(module, q, k, result.lse, kwargs)
        return result.out, result.weights
    return attend


def _watch(module: nn.Module, observe) -> None:
    observers = _OBSERVERS.setdefault(module, [])
    if not observers:
        module.attend = _wrapped_attend(module, observers)
    observers.append(observe)


def _unwatch(module: nn.Module, observe) -> None:
    observers = _OBSERVERS[module]
    observers.remove(observe)
    if not observers:
        del _OBSERVERS[module]
        del module.attend  # the class's own method again


@contextlib.contextmanager
def _watching(observed: list[tuple[nn.Module, object]]) -> Iterator[None]:
    """Each (layer, observe) pair watched for the block, and unwatched after it, also when
    the block raises (a layer is watched by then or not at all)."""
    watched = []
    try:
        for module, observe in observed:
            _watch(module, observe)
            watched.append((module, observe))
        yield
    finally:
        for module, observe in watched:
            _unwatch(module, observe)


@contextlib.contextmanager
def watch(model: nn.Module, on_call, *, layers=None) -> Iterator[list[CapturedMap]]:
    """Hand every call of the chosen self- and cross-attention layers to
    ``on_call(site, q, k, kwargs, lse)`` (q, k detached, as the engine saw them; kwargs: the
    call's mask, score_mod, similarity, scale, metric; lse: the engine's (B, H, Nq)
    log-sum-exp, None from SDPA), computing no weights: what a caller keeps of them
    (``qkv viz --serve`` keeps q and k on disk, ``qkv.viz.summaries`` per-row summaries) is
    its own. Yields the watched sites."""
    plan = _plan(model, layers, None, None, None)

    def observer(site):
        def observe(module, q, k, lse, kwargs):
            on_call(site, q.detach(), k.detach(), kwargs, None if lse is None else lse.detach())
        return observe

    with _watching([(module, observer(site)) for module, site in plan]):
        yield [site for _, site in plan]


@contextlib.contextmanager
def capture(
    model: nn.Module, *, layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None, stacks: str | Sequence[str] | None = None,
    cross: bool | None = None, on_weights: OnWeights | None = None,
    row_bytes: int | None = None,
) -> Iterator[AttentionMaps]:
    """Record the post-softmax weights of chosen layers and heads during forward passes.

    Args:
        model: any module whose attention layers sit at paths ``...self_attn`` or
            ``...cross_attn`` (``attention_layers``).
        layers: layer indices within each stack (negative counts from the end); None: all.
        heads: query-head indices; None: all.
        stacks: limit to these stacks, e.g. "encoder" or "decoder" (the module path up to the
            layer number; ``AttentionMaps.stacks`` lists them).
        cross: True for cross-attention layers only, False for self-attention only.
        on_weights: streaming: each call's (B, len(heads), Nq, Nk) weights go to
            ``on_weights(site, weights, call)`` (``call``: the layer's q, k, mask and score
            modifier) instead of into ``site.calls``, so nothing accumulates; the callback
            keeps what it needs (e.g. ``qkv.viz.compact.RowsBuilder``) and drops the rest.
        row_bytes: with on_weights, hand a long call's weights over a block of query rows at
            a time, each at most this many bytes of float32 (``call.first_row`` says where the
            block starts), so a long sequence never holds its whole (len(heads), Nq, Nk) maps.

    Yields:
        AttentionMaps, filled as the model runs.
    """
    plan = _plan(model, layers, heads, stacks, cross)
    with _watching([(module, _observer(site, on_weights, row_bytes)) for module, site in plan]):
        yield AttentionMaps([site for _, site in plan])
