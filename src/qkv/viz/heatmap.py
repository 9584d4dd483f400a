"""A cross-attention heatmap PNG from the encoder-decoder's own attention weights."""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.tokenizers import BOS_ID
from .capture import capture
from .labels import token_labels
from .plots import plot_alignment, save_figure


def cross_attention_weights(model, src_ids: list[int], tgt_ids: list[int]) -> list[torch.Tensor]:
    """Per decoder layer, the cross-attention weights (H, T, S) of a teacher-forced pass with
    target input [bos] + tgt_ids (T = len(tgt_ids) + 1 rows: each output token and eos).

    Captured with ``qkv.viz.capture``: the layers keep their fast engine, and an attention kind
    without weights (linear attention) raises a ValueError that says so."""
    device = next(model.parameters()).device
    src = torch.tensor([src_ids], device=device)
    tgt = torch.tensor([[BOS_ID] + tgt_ids], device=device)
    model.eval()
    with capture(model, cross=True) as maps, torch.no_grad():
        model(src, tgt)
    return [site.weights[0].float().cpu() for site in maps.select(cross=True)]


def cross_attention_png(model, src_tok, tgt_tok, source: str, translation: str, path) -> Path:
    """Plot the last decoder layer's cross-attention, averaged over heads, for one pair."""
    src_ids, tgt_ids = src_tok.encode(source), tgt_tok.encode(translation)
    weights = cross_attention_weights(model, src_ids, tgt_ids)[-1].mean(0)  # (T, S)
    fig = plot_alignment(
        weights, token_labels(src_tok, src_ids), token_labels(tgt_tok, tgt_ids) + ["<eos>"],
        title="cross-attention\n(last decoder layer, mean of heads)",
    )
    return save_figure(fig, path)
