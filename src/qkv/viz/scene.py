"""What ``qkv viz`` shows for one source (a run directory or a pretrained model), and the
steps every source shares: encoding the text within the context, and recording the maps."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..allocations import map_large_allocations
from ..bars import bar
from .capture import AttentionMaps, capture, watch
from .long_record import LongRecorder
from .page import PageImage, PageView
from .record import NEURON_BUDGET, Recorder, neuron_layers_within

# float32 weights computed at once per captured layer: SmolLM2's 9 heads at 8k keys take 227
# query rows a block.
ROW_BYTES = 64 << 20
# Past this many tokens a page holds every head's per-row summaries and the maps of the
# chosen layers and heads only (``long_record``): SmolLM2's 270 maps at 2,048 tokens fill
# the page's budget.
LONG_INPUT = 2048


@dataclass
class Scene:
    """What one run shows: the page's views, its mode, and the ViT image when there is one."""

    mode: str
    views: list[PageView]
    image: PageImage | None = None
    relevance: torch.Tensor | None = None  # (gh, gw) ViT rollout over the patches


def encode_text(tokenizer, text: str | None, limit: int, task: str, extra: int = 0) -> list[int]:
    if text is None:
        raise ValueError(f"{task} needs --text (the text to look at)")
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("--text encodes to no tokens")
    if len(ids) + extra > limit:
        more = f" plus {extra} generated" if extra else ""
        raise ValueError(f"--text is {len(ids)} tokens long{more} but the model's context holds "
                         f"{limit}; shorten it")
    return ids


def _neuron_layers(args, model, count: int, tokens: int) -> list[int]:
    """--neuron-layers checked against the layer count and --layers, or the first captured
    layers that fit the default budget."""
    # Among the captured layers (capture itself reports an --layers entry out of range).
    captured = sorted({layer % count for layer in args.layers if -count <= layer < count}) \
        if args.layers else list(range(count))
    if args.neuron_layers is not None:
        for layer in args.neuron_layers:
            if not -count <= layer < count:
                raise ValueError(f"--neuron-layers: layer {layer} is out of range: valid layers "
                                 f"are 0..{count - 1}")
            if layer % count not in captured:
                raise ValueError(f"--neuron-layers: layer {layer} is not captured; --layers "
                                 f"captures {captured}")
        return sorted({layer % count for layer in args.neuron_layers})
    block = model.config.block
    heads = len(args.heads) if args.heads else block.n_head
    kv_heads = min(heads, block.n_kv_head or block.n_head)
    return neuron_layers_within(NEURON_BUDGET, captured, heads, kv_heads, tokens,
                                block.head_dim)


@contextlib.contextmanager
def without_head(model):
    """The model's LM head (if it has one) replaced by the identity for the block: a forward
    pass whose logits nobody reads skips the (N, vocab) matrix, 1.6 GB for SmolLM2 at 8k
    tokens."""
    head = getattr(model, "lm_head", None)
    if head is None:
        yield model
        return
    model.lm_head = torch.nn.Identity()
    try:
        yield model
    finally:
        model.lm_head = head


def record_maps(model, args, forward, *, layer_count: int, tokens: int,
                rollout_stacks=()) -> tuple[AttentionMaps, Recorder]:
    """Run ``forward`` under capture, streaming every call into a Recorder, with a progress bar
    over the rows of every captured layer. Without a rollout (which needs whole maps), a
    long call's weights come ``ROW_BYTES`` at a time: memory stays bounded at any length.
    Past ``LONG_INPUT`` tokens (and without a rollout) the recorder is a ``LongRecorder``."""
    map_large_allocations()
    if tokens > LONG_INPUT and not rollout_stacks:
        return _record_long(model, args, forward, tokens)
    recorder = Recorder(args.threshold, args.max_per_row,
                        _neuron_layers(args, model, layer_count, tokens),
                        rollout_stacks if args.layers is None else ())
    row_bytes = None if recorder.rollout_stacks else ROW_BYTES
    with bar(desc="attention maps", unit="row") as progress:
        def on_weights(site, weights, call):
            recorder(site, weights, call)
            progress.update(weights.shape[2])

        with capture(model, layers=args.layers, heads=args.heads, on_weights=on_weights,
                     row_bytes=row_bytes) as maps, torch.no_grad():
            progress.total = len(maps) * tokens
            forward()
    return maps, recorder


def _chosen(args, sites) -> tuple[list[int], list[int] | None]:
    """--layers as sorted layer indices (the last layer when neither --layers nor --heads is
    given) and --heads, checked against the model's layers and heads."""
    count, n_head = len(sites), len(sites[0].heads)
    for flag, given, limit in (("--layers", args.layers, count), ("--heads", args.heads, n_head)):
        for index in given or ():
            low = -count if flag == "--layers" else 0
            if not low <= index < limit:
                raise ValueError(f"{flag}: {index} is out of range: valid {flag[2:]} are "
                                 f"0..{limit - 1}")
    if args.layers is None:
        return ([count - 1] if args.heads is None else list(range(count))), args.heads
    return sorted({layer % count for layer in args.layers}), args.heads


def _record_long(model, args, forward, tokens: int) -> tuple[AttentionMaps, LongRecorder]:
    """``record_maps`` past ``LONG_INPUT``: every layer and head watched for its summaries;
    the maps of --layers and --heads, or of the last layer without either."""
    with bar(desc="attention summaries", unit="row") as progress:
        def on_call(site, q, k, kwargs, lse):
            recorder(site, q, k, kwargs, lse)
            progress.update(q.shape[2])

        with watch(model, on_call) as sites, torch.no_grad():
            recorder = LongRecorder(args.threshold, args.max_per_row, *_chosen(args, sites))
            progress.total = len(sites) * tokens
            forward()
    return AttentionMaps(sites), recorder
