"""One self-contained HTML page of attention: data, script and style inline, no CDN.

A page holds views; each view is one attention site (GPT's self-attention, an encoder's, a
decoder's self- or cross-attention, a ViT's) with its tokens and the weights of its chosen
layers and heads. The page lets the reader pick a view, a layer and a head (or all heads,
coloured per head), hover tokens, switch to a graph of the layer, and, for a ViT, see the
patches on the image."""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..data.atomic import write_text_atomic
from .page_script import SCRIPT, STYLE

MODES = ("gpt", "encoder", "seq2seq", "vit")
KINDS = ("self", "cross")
_DECIMALS = 4


@dataclass
class PageView:
    """One attention site for the page.

    weights: (L, H, Nq, Nk) for one example, L = len(layers), H = len(heads).
    rollout: optional (Nq, Nk) rollout of this self-attention stack."""

    name: str
    kind: str
    query_tokens: list[str]
    key_tokens: list[str]
    layers: list[int]
    heads: list[int]
    weights: Tensor
    rollout: Tensor | None = None

    def check(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"view {self.name!r}: kind must be one of {KINDS}; got {self.kind!r}")
        expected = (len(self.layers), len(self.heads), len(self.query_tokens),
                    len(self.key_tokens))
        if tuple(self.weights.shape) != expected:
            raise ValueError(
                f"view {self.name!r}: weights must be (layers, heads, Nq, Nk) = {expected}; "
                f"got {tuple(self.weights.shape)}"
            )
        if self.rollout is not None and tuple(self.rollout.shape) != expected[2:]:
            raise ValueError(
                f"view {self.name!r}: rollout must be (Nq, Nk) = {expected[2:]}; got "
                f"{tuple(self.rollout.shape)}"
            )


@dataclass
class PageImage:
    """The ViT's input: pixels (H, W) grey or (C, H, W), any range (scaled to [0, 1]), split
    into a (gh, gw) grid of patches; ``cls_token`` when token 0 is a class token."""

    pixels: Tensor
    grid: tuple[int, int]
    cls_token: bool

    def as_json(self) -> dict:
        pixels = self.pixels.detach().to(torch.float64).cpu()
        if pixels.dim() == 3:
            pixels = pixels[0] if pixels.shape[0] == 1 else pixels.permute(1, 2, 0)
        if pixels.dim() not in (2, 3):
            raise ValueError(f"image pixels must be (H, W) or (C, H, W); got {tuple(pixels.shape)}")
        lo, hi = pixels.min(), pixels.max()
        pixels = (pixels - lo) / (hi - lo) if hi > lo else torch.zeros_like(pixels)
        height, width = pixels.shape[:2]
        gh, gw = self.grid
        if height % gh or width % gw:
            raise ValueError(f"a {gh}x{gw} patch grid does not tile a {height}x{width} image")
        return {"pixels": _rounded(pixels, 3), "grid": [gh, gw], "cls": self.cls_token}


def _rounded(t: Tensor, decimals: int = _DECIMALS):
    return torch.round(t.detach().to(torch.float64).cpu(), decimals=decimals).tolist()


def page_data(views: list[PageView], *, mode: str, image: PageImage | None = None,
              threshold: float = 0.01) -> dict:
    """The JSON the page's script reads."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if not views:
        raise ValueError("a page needs at least one view")
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"threshold must be in [0, 1); got {threshold}")
    if mode == "vit" and image is None:
        raise ValueError("mode='vit' needs the image (PageImage)")
    for v in views:
        v.check()
    return {
        "mode": mode,
        "threshold": threshold,
        "image": None if image is None else image.as_json(),
        "views": [
            {
                "name": v.name, "kind": v.kind, "query_tokens": list(map(str, v.query_tokens)),
                "key_tokens": list(map(str, v.key_tokens)), "layers": list(v.layers),
                "heads": list(v.heads), "weights": _rounded(v.weights),
                "rollout": None if v.rollout is None else _rounded(v.rollout),
            }
            for v in views
        ],
    }


def render_page(views: list[PageView], *, mode: str, title: str = "qkv attention",
                image: PageImage | None = None, threshold: float = 0.01) -> str:
    """The page as one HTML string."""
    data = json.dumps(page_data(views, mode=mode, image=image, threshold=threshold))
    # "</" inside the JSON would close the script element early (a token can be anything).
    data = data.replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<h3>{html.escape(title)}</h3>
<div id="controls">
<label>attention <select id="view"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<label>show <select id="display"></select></label>
</div>
<div id="legend"></div>
<svg id="canvas" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="info">hover a token</div>
<script type="application/json" id="qkv-data">{data}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write_page(path, views: list[PageView], **kwargs) -> Path:
    """Write ``render_page(views, **kwargs)`` to ``path`` (UTF-8), atomically: an interrupted
    write leaves the previous page, never half of one."""
    return write_text_atomic(path, render_page(views, **kwargs))
