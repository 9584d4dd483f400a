"""Seeing attention: maps captured from the fast path, rollout, pictures and a page."""

from .capture import AttentionMaps, CapturedMap, attention_layers, capture
from .labels import token_labels
from .notebook import AttentionView, show
from .page import PageImage, PageView, read_page, render_page, write_page
from .patching import patching_svg, patching_view
from .rollout import attention_rollout, patch_relevance, rollout_step
from .weights import head_weights

__all__ = [
    "AttentionMaps", "AttentionView", "CapturedMap", "PageImage", "PageView", "attention_layers",
    "attention_rollout", "capture", "head_weights", "patch_relevance", "patching_svg",
    "patching_view", "read_page", "render_page", "rollout_step", "show", "token_labels",
    "write_page",
]
