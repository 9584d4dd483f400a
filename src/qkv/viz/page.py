"""One self-contained HTML page of attention: data, script and style inline, no CDN.

A page holds views; each view is one attention site (GPT's self-attention, an encoder's, a
decoder's self- or cross-attention, a ViT's) with its tokens and the weights of its chosen
layers and heads. The page lets the reader pick a view, a layer and a head (or all heads,
coloured per head), hover tokens, switch to a graph of the layer, and, for a ViT, see the
patches on the image."""

from __future__ import annotations

import base64
import gzip
import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..data.atomic import write_text_atomic
from . import page_rows
from .compact import LEVELS, SUMMARY_COLUMNS, HeadRows, compress_dense, compress_head
from .neuron import NeuronLayer
from .page_script import SCRIPT, STYLE

MODES = ("gpt", "encoder", "seq2seq", "vit")
KINDS = ("self", "cross")


@dataclass
class PageView:
    """One attention site for the page, for one example.

    Either ``weights`` (L, H, Nq, Nk) dense, L = len(layers), H = len(heads) (small inputs;
    the page stores them compactly), or ``rows`` [layer][head] already compact with
    ``summary`` (L, H, 4) (``qkv.viz.compact``; what ``qkv viz`` streams out of capture).
    rollout: optional (Nq, Nk) rollout of this self-attention stack. neurons: per-dimension
    data of some layers. first_generated: index of the first generated token, if any.
    row_stats: one ``summaries.HeadStats`` per layer over all the heads (long inputs); with
    it, ``rows`` is None for the heads whose maps the page leaves out. omitted: sentences the
    page shows about what it leaves out."""

    name: str
    kind: str
    query_tokens: list[str]
    key_tokens: list[str]
    layers: list[int]
    heads: list[int]
    weights: Tensor | None = None
    rollout: Tensor | None = None
    rows: list[list[HeadRows]] | None = None
    summary: np.ndarray | None = None
    neurons: list[NeuronLayer] = field(default_factory=list)
    first_generated: int | None = None
    row_stats: list | None = None
    omitted: list[str] = field(default_factory=list)

    def check(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"view {self.name!r}: kind must be one of {KINDS}; got {self.kind!r}")
        expected = (len(self.layers), len(self.heads), len(self.query_tokens),
                    len(self.key_tokens))
        if (self.weights is None) == (self.rows is None):
            raise ValueError(f"view {self.name!r}: give weights (dense) or rows (compact)")
        if self.weights is not None and tuple(self.weights.shape) != expected:
            raise ValueError(
                f"view {self.name!r}: weights must be (layers, heads, Nq, Nk) = {expected}; "
                f"got {tuple(self.weights.shape)}"
            )
        if self.rows is not None:
            shape = (len(self.rows), len(self.rows[0]) if self.rows else 0)
            nq = {len(r.counts) for layer in self.rows for r in layer if r is not None}
            mapped = nq == {expected[2]} or (not nq and self.row_stats is not None)
            missing = any(r is None for layer in self.rows for r in layer)
            if shape != expected[:2] or not mapped or self.summary is None or (
                    missing and self.row_stats is None):
                raise ValueError(f"view {self.name!r}: rows must be [layers][heads] = "
                                 f"{expected[:2]} of {expected[2]} query rows, with a summary "
                                 "(and with row_stats where a head has no rows)")
        if self.row_stats is not None and [len(s.heads) for s in self.row_stats] != \
                [len(self.heads)] * len(self.layers):
            raise ValueError(f"view {self.name!r}: row_stats must hold every head of every "
                             "layer")
        if self.rollout is not None and tuple(self.rollout.shape) != expected[2:]:
            raise ValueError(
                f"view {self.name!r}: rollout must be (Nq, Nk) = {expected[2:]}; got "
                f"{tuple(self.rollout.shape)}"
            )

    def compact(self, threshold: float, max_per_row: int | None):
        """(rows [layer][head], summary means (L, H, 4))."""
        if self.rows is not None:
            return self.rows, self.summary
        return compress_dense(self.weights.detach().float().cpu(), threshold, max_per_row)


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


def _rounded(t: Tensor, decimals: int):
    return torch.round(t.detach().to(torch.float64).cpu(), decimals=decimals).tolist()


class Blob:
    """Typed arrays packed into one byte string, each at a 4-byte aligned offset; the page
    reads them as ``[type, offset, length]`` views of one ArrayBuffer."""

    TYPES = {"u8": np.uint8, "u16": np.uint16, "u32": np.uint32, "f32": np.float32}

    def __init__(self):
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, array, kind: str) -> list:
        data = np.ascontiguousarray(np.asarray(array).astype(self.TYPES[kind])).tobytes()
        offset = self.size
        pad = (-len(data)) % 4
        self.parts.append(data + b"\0" * pad)
        self.size += len(data) + pad
        return [kind, offset, len(data) // np.dtype(self.TYPES[kind]).itemsize]

    def bytes(self) -> bytes:
        return b"".join(self.parts)


def _index_kind(n: int) -> str:
    return "u16" if n <= 0xFFFF else "u32"


def _pack_rows(blob: Blob, rows: HeadRows, nk: int) -> dict:
    """Columns as differences within each row (small numbers gzip well); dropped mass as
    one byte per row."""
    starts = np.concatenate([[0], np.cumsum(rows.counts)[:-1]]).astype(np.int64)
    deltas = rows.cols.astype(np.int64).copy()
    if len(deltas):
        previous = np.concatenate([[0], rows.cols[:-1]]).astype(np.int64)
        first = np.zeros(len(deltas), bool)
        first[starts[rows.counts > 0]] = True
        deltas = np.where(first, deltas, deltas - previous)
    kind = _index_kind(nk)
    return {
        "counts": blob.add(rows.counts, kind), "cols": blob.add(deltas, kind),
        "values": blob.add(rows.values, "u8"),
        "dropped": blob.add(np.round(np.clip(rows.dropped, 0, 1) * LEVELS), "u8"),
        "left_out": [round(float(rows.dropped.mean()), 4) if len(rows.dropped) else 0.0,
                     round(float(rows.dropped.max()), 4) if len(rows.dropped) else 0.0],
    }


def _pack_neuron(blob: Blob, n: NeuronLayer, layer_index: int) -> dict:
    return {
        "layer": layer_index, "similarity": n.similarity, "kernel": n.kernel,
        "scale": [float(s) for s in n.scale], "dims": int(n.q_features.shape[-1]),
        "q": blob.add(n.q_features.ravel(), "f32"), "k": blob.add(n.k_features.ravel(), "f32"),
        "k_of_head": list(n.k_of_head),
        "scores": [blob.add(s, "f32") for s in n.scores],
        "similarity_scores": None if n.similarity_scores is None
        else [blob.add(s, "f32") for s in n.similarity_scores],
    }


def _pack_view(blob: Blob, v: PageView, threshold: float, max_per_row: int | None) -> dict:
    rows, summary = v.compact(threshold, max_per_row)
    nk = len(v.key_tokens)
    rollout = None
    if v.rollout is not None:
        rollout = _pack_rows(blob, compress_head(v.rollout.detach().float().cpu(), threshold,
                                                 max_per_row), nk)
    return {
        "name": v.name, "kind": v.kind, "query_tokens": list(map(str, v.query_tokens)),
        "key_tokens": list(map(str, v.key_tokens)), "layers": list(v.layers),
        "heads": list(v.heads), "first_generated": v.first_generated,
        "maps": [[None if r is None else _pack_rows(blob, r, nk) for r in layer]
                 for layer in rows],
        "summary": np.round(np.asarray(summary, np.float64), 4).tolist(),
        "rollout": rollout,
        "neurons": [_pack_neuron(blob, n, v.layers.index(n.layer)) for n in v.neurons],
        "row_stats": None if v.row_stats is None else
        page_rows.pack(blob, v.row_stats, len(v.query_tokens), nk),
        "omitted": list(v.omitted),
    }


def page_data(views: list[PageView], *, mode: str, image: PageImage | None = None,
              threshold: float = 0.01, max_per_row: int | None = None) -> tuple[dict, bytes]:
    """The JSON the page's script reads, and the binary arrays it points into."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}; got {mode!r}")
    if not views:
        raise ValueError("a page needs at least one view")
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold must be in (0, 1); got {threshold}")
    if max_per_row is not None and max_per_row < 1:
        raise ValueError(f"max_per_row must be at least 1; got {max_per_row}")
    if mode == "vit" and image is None:
        raise ValueError("mode='vit' needs the image (PageImage)")
    for v in views:
        v.check()
    blob = Blob()
    meta = {
        "mode": mode, "threshold": threshold, "max_per_row": max_per_row, "levels": LEVELS,
        "summary_columns": list(SUMMARY_COLUMNS),
        "image": None if image is None else image.as_json(),
        "views": [_pack_view(blob, v, threshold, max_per_row) for v in views],
    }
    return meta, blob.bytes()


def render_page(views: list[PageView], *, mode: str, title: str = "qkv attention",
                image: PageImage | None = None, threshold: float = 0.01,
                max_per_row: int | None = None) -> str:
    """The page as one HTML string: the JSON, and the arrays gzip-compressed and base64
    encoded (the browser inflates them with its own DecompressionStream; nothing is fetched)."""
    meta, arrays = page_data(views, mode=mode, image=image, threshold=threshold,
                             max_per_row=max_per_row)
    # "</" inside the JSON would close the script element early (a token can be anything).
    data = json.dumps(meta, ensure_ascii=False).replace("</", "<\\/")
    packed = base64.b64encode(gzip.compress(arrays, compresslevel=6, mtime=0)).decode("ascii")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<h3>{html.escape(title)}</h3>
<div id="controls">
<label>attention <select id="view"></select></label>
<label>show <select id="display"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
<span id="pair"></span>
</div>
<div id="legend"></div>
<div id="stage"><svg id="canvas" xmlns="http://www.w3.org/2000/svg"></svg></div>
<div id="info">hover a token</div>
<div id="omitted"></div>
<script type="application/json" id="qkv-data">{data}</script>
<script type="application/octet-stream" id="qkv-arrays">{packed}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write_page(path, views: list[PageView], **kwargs) -> Path:
    """Write ``render_page(views, **kwargs)`` to ``path`` (UTF-8), atomically: an interrupted
    write leaves the previous page, never half of one."""
    return write_text_atomic(path, render_page(views, **kwargs))


@dataclass
class StoredPage:
    """A written page read back (tests, benchmarks): its JSON and its arrays."""

    meta: dict
    arrays: bytes

    def array(self, ref: list) -> np.ndarray:
        kind, offset, length = ref
        return np.frombuffer(self.arrays, Blob.TYPES[kind], length, offset)

    def rows(self, ref: dict) -> HeadRows:
        counts = self.array(ref["counts"]).astype(np.int64)
        cols = self.array(ref["cols"]).astype(np.int64)
        # Undo the per-row differences: a running sum restarted at each row's first entry.
        starts = np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
        total = np.cumsum(cols)
        absolute = total - np.concatenate([[0], total])[starts]
        return HeadRows(counts, absolute, self.array(ref["values"]),
                        self.array(ref["dropped"]) / LEVELS)

    def row_stats(self, view: int, layer: int, head: int) -> dict[str, np.ndarray]:
        """The stored per-row summaries of one head (positions in the view's lists) as the
        page's script decodes them: {series: (Nq,) or "received": (Nk,)}."""
        stored = self.meta["views"][view]["row_stats"]
        return {name: page_rows.decode(self.array(ref), *stored["scales"][name])
                for name, ref in stored["layers"][layer][head].items()}

    def weights(self, view: int, layer: int, head: int) -> np.ndarray:
        """The stored (Nq, Nk) weights of one head (layer and head are positions in the view's
        lists), left-out entries 0."""
        v = self.meta["views"][view]
        return self.rows(v["maps"][layer][head]).dense(len(v["key_tokens"]))


def read_page(path) -> StoredPage:
    text = Path(path).read_text(encoding="utf-8")
    meta = re.search(r'<script type="application/json" id="qkv-data">(.*?)</script>', text, re.S)
    arrays = re.search(r'<script type="application/octet-stream" id="qkv-arrays">(.*?)</script>',
                       text, re.S)
    if meta is None or arrays is None:
        raise ValueError(f"{path} is not a qkv attention page")
    return StoredPage(json.loads(meta.group(1).replace("<\\/", "</")),
                      gzip.decompress(base64.b64decode(arrays.group(1))))
