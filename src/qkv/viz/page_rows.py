"""The per-row summaries of every head (``qkv.viz.summaries.HeadStats``) as the page stores
them: one byte per value.

SmolLM2 at 8,192 tokens has 270 heads x 8,192 rows; four float32 values a row and one a key
would take 44 MB, more than the page's budget. A byte a value is finer than a plot of the
rows can show (a pixel column holds about eight rows): entropy to 1/255 of log2(Nk) bits
(0.05 bits at 8k), the first- and previous-token mass to 1/255, and the two quantities that
span orders of magnitude on a log scale: the mean distance (0 to Nk - 1 tokens) and the mass a
key receives (0 to Nq), each code c standing for 2^(c/255 · log2(1 + top)) - 1 (about 3.6 %
apart at 8k). Each head's rows come one array after another, which gzip packs further.
"""

from __future__ import annotations

import math

import numpy as np
import torch

LEVELS = 255
ROW_SERIES = ("entropy", "distance", "sink", "previous")


def scales(nq: int, nk: int) -> dict[str, list]:
    """{series: [scale, top]}: "linear" codes c/255·top, "log" codes 2^(c/255·log2(1+top))-1."""
    return {"entropy": ["linear", math.log2(max(2, nk))], "distance": ["log", max(1, nk - 1)],
            "sink": ["linear", 1.0], "previous": ["linear", 1.0], "received": ["log", max(1, nq)]}


def encode(values: np.ndarray, scale: str, top: float) -> np.ndarray:
    """float values in [0, top] -> uint8 codes (values outside are clipped)."""
    values = np.clip(np.asarray(values, np.float64), 0.0, top)
    unit = values / top if scale == "linear" else np.log2(1.0 + values) / math.log2(1.0 + top)
    return np.round(unit * LEVELS).astype(np.uint8)


def decode(codes: np.ndarray, scale: str, top: float) -> np.ndarray:
    """The values uint8 ``codes`` stand for (what the page's script computes)."""
    unit = np.asarray(codes, np.float64) / LEVELS
    return unit * top if scale == "linear" else np.exp2(unit * math.log2(1.0 + top)) - 1.0


def pack(blob, stats: list, nq: int, nk: int) -> dict:
    """The page's JSON for one view's summaries (``stats``: one ``summaries.HeadStats`` per
    layer, in the view's layer order): the scales, and per layer and head a ``blob``
    reference per series. A model whose rows do not sum to 1 (a weighting that does not
    normalize) also gets each row's mass, on a log scale up to the largest (a negative
    mass, under the identity weighting, shows as 0)."""
    found = scales(nq, nk)
    series = (*ROW_SERIES, "received")
    if any(not torch.allclose(layer.mass, torch.ones_like(layer.mass)) for layer in stats):
        top = max(float(layer.mass.max()) for layer in stats)
        found["mass"] = ["log", max(1.0, top)]
        series = (*series, "mass")
    layers = []
    for layer in stats:
        heads = []
        for h in range(len(layer.heads)):
            refs = {name: blob.add(encode(getattr(layer, name)[h].numpy(), *found[name]), "u8")
                    for name in series}
            heads.append(refs)
        layers.append(heads)
    return {"scales": found, "layers": layers}
