"""What ``qkv viz`` shows for one source (a run directory or a pretrained model), and the
steps every source shares: encoding the text within the context, and recording the maps."""

from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass

import torch

from ..bars import bar
from .capture import AttentionMaps, capture
from .page import PageImage, PageView
from .record import NEURON_BUDGET, Recorder, neuron_layers_within

# float32 weights computed at once per captured layer: SmolLM2's 9 heads at 8k keys take 227
# query rows a block.
ROW_BYTES = 64 << 20


# glibc's mallopt parameter: allocations of at least this many bytes are mapped pages.
_M_MMAP_THRESHOLD = -3


@functools.cache
def map_large_allocations(threshold: int = 1 << 20) -> None:
    """Make glibc serve every allocation of ``threshold`` bytes or more with its own mapped
    pages, returned to the system when freed. Maps are computed a block of rows at a time:
    glibc otherwise raises its threshold to 32 MB after the first large free, carves the
    blocks from the heap, and the small tensors kept between them (per-row summaries, compact
    rows) pin the freed space: SmolLM2 at 8,192 tokens grew by 270-540 MB a layer, and by
    under 10 MB with the threshold fixed (docs/viz.md, "Long texts"). Once per process;
    elsewhere than glibc this does nothing."""
    try:
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)  # the process's own C library
    except (OSError, TypeError):  # Windows has no CDLL(None)
        return
    if mallopt is not None:
        mallopt(_M_MMAP_THRESHOLD, threshold)


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
    long call's weights come ``ROW_BYTES`` at a time: memory stays bounded at any length."""
    map_large_allocations()
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


