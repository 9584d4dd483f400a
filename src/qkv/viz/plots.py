"""Pictures of attention with matplotlib: one head, every head of a layer, a source x target
alignment, and a ViT relevance map over its image. Each function returns a Figure;
``save_figure`` writes PNG or SVG by the file's suffix."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never open a window, never need a display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from ..data.atomic import write_atomic  # noqa: E402

FORMATS = (".png", ".svg")


def _matrix(weights, name: str, dims: int = 2) -> np.ndarray:
    array = np.asarray(weights.detach().cpu() if hasattr(weights, "detach") else weights)
    if array.ndim != dims:
        layout = "(Nq, Nk)" if dims == 2 else "(H, Nq, Nk)"
        raise ValueError(f"{name} must be {layout}; got shape {array.shape}")
    return array.astype(np.float64)


def _check_labels(labels: Sequence[str] | None, n: int, name: str) -> list[str]:
    if labels is None:
        return [str(i) for i in range(n)]
    labels = [str(t) for t in labels]
    if len(labels) != n:
        raise ValueError(f"{name} has {len(labels)} labels but the weights have {n} positions")
    return labels


def _draw(ax, matrix: np.ndarray, q_labels: list[str], k_labels: list[str], title: str):
    image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=max(1e-12, float(matrix.max())))
    # Label every token while they stay readable; past that, matplotlib's own ticks.
    if len(k_labels) <= 64:
        ax.set_xticks(range(len(k_labels)), k_labels, rotation=90, fontsize=7)
    if len(q_labels) <= 64:
        ax.set_yticks(range(len(q_labels)), q_labels, fontsize=7)
    ax.set_title(title, fontsize=9)
    return image


def plot_head(
    weights, query_tokens: Sequence[str] | None = None, key_tokens: Sequence[str] | None = None,
    *, title: str = "attention",
) -> Figure:
    """Heatmap of one head: weights (Nq, Nk), queries down the rows, keys along the columns;
    ``key_tokens`` default to ``query_tokens`` (self-attention)."""
    matrix = _matrix(weights, "weights")
    q_labels = _check_labels(query_tokens, matrix.shape[0], "query_tokens")
    k_labels = _check_labels(key_tokens if key_tokens is not None else query_tokens,
                             matrix.shape[1], "key_tokens")
    size = min(12.0, 2.5 + 0.25 * max(matrix.shape))
    fig, ax = plt.subplots(figsize=(size, size))
    image = _draw(ax, matrix, q_labels, k_labels, title)
    ax.set_xlabel("key (attended to)")
    ax.set_ylabel("query (attending)")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def plot_heads(
    weights, query_tokens: Sequence[str] | None = None, key_tokens: Sequence[str] | None = None,
    *, heads: Sequence[int] | None = None, title: str = "layer",
) -> Figure:
    """A grid with one heatmap per head: weights (H, Nq, Nk); ``heads`` names the panels
    (default 0..H-1)."""
    stack = _matrix(weights, "weights", dims=3)
    count = stack.shape[0]
    names = list(range(count)) if heads is None else list(heads)
    if len(names) != count:
        raise ValueError(f"heads names {len(names)} panels but weights hold {count} heads")
    q_labels = _check_labels(query_tokens, stack.shape[1], "query_tokens")
    k_labels = _check_labels(key_tokens if key_tokens is not None else query_tokens,
                             stack.shape[2], "key_tokens")
    cols = math.ceil(math.sqrt(count))
    rows = math.ceil(count / cols)
    panel = min(5.0, 1.5 + 0.15 * max(stack.shape[1:]))
    fig, axes = plt.subplots(rows, cols, figsize=(panel * cols, panel * rows), squeeze=False)
    for index, ax in enumerate(axes.flat):
        if index < count:
            _draw(ax, stack[index], q_labels, k_labels, f"{title} head {names[index]}")
        else:
            ax.axis("off")
    fig.tight_layout()
    return fig


def plot_alignment(
    cross_weights, source_tokens: Sequence[str], target_tokens: Sequence[str],
    *, title: str = "cross-attention",
) -> Figure:
    """Encoder-decoder alignment: cross_weights (T, S), source tokens along x, target down y."""
    matrix = _matrix(cross_weights, "cross_weights")
    tgt = _check_labels(target_tokens, matrix.shape[0], "target_tokens")
    src = _check_labels(source_tokens, matrix.shape[1], "source_tokens")
    fig, ax = plt.subplots(figsize=(min(12.0, 2.5 + 0.3 * len(src)),
                                    min(12.0, 2.5 + 0.3 * len(tgt))))
    image = _draw(ax, matrix, tgt, src, title)
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    return fig


def plot_image_relevance(image, relevance, *, title: str = "attention rollout") -> Figure:
    """The image, and the image with a patch relevance map over it.

    image (H, W) grey or (C, H, W) with C in {1, 3}; relevance (gh, gw), e.g. from
    ``patch_relevance``; each patch covers (H/gh, W/gw) pixels."""
    pixels = np.asarray(image.detach().cpu() if hasattr(image, "detach") else image, dtype=float)
    if pixels.ndim == 3:
        if pixels.shape[0] not in (1, 3):
            raise ValueError(f"image must be (H, W) or (C, H, W) with C 1 or 3; got {pixels.shape}")
        pixels = pixels[0] if pixels.shape[0] == 1 else pixels.transpose(1, 2, 0)
    elif pixels.ndim != 2:
        raise ValueError(f"image must be (H, W) or (C, H, W); got shape {pixels.shape}")
    grid = _matrix(relevance, "relevance")
    height, width = pixels.shape[:2]
    if height % grid.shape[0] or width % grid.shape[1]:
        raise ValueError(
            f"a {grid.shape[0]}x{grid.shape[1]} patch grid does not tile a {height}x{width} image"
        )
    lo, hi = float(pixels.min()), float(pixels.max())
    shown = (pixels - lo) / (hi - lo) if hi > lo else np.zeros_like(pixels)
    fig, (left, right) = plt.subplots(1, 2, figsize=(7, 3.5))
    cmap = "gray" if shown.ndim == 2 else None
    for ax in (left, right):
        ax.imshow(shown, cmap=cmap, extent=(0, width, height, 0))
        ax.set_xticks([])
        ax.set_yticks([])
    left.set_title("image", fontsize=9)
    right.imshow(grid, cmap="inferno", alpha=0.6, extent=(0, width, height, 0),
                 interpolation="nearest", vmin=0.0)
    right.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def save_figure(fig: Figure, path) -> Path:
    """Write ``fig`` as PNG or SVG (by the suffix of ``path``), atomically, and close it."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"figure path must end in .png or .svg; got {str(path)!r}")
    try:
        return write_atomic(path, lambda temp: fig.savefig(temp, format=suffix[1:], dpi=120))
    finally:
        plt.close(fig)
