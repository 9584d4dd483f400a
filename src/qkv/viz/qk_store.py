"""The q and k of every attention layer of one forward pass, kept on disk, from which any
row or window of any head's map is computed when it is asked for (``qkv viz --serve``).

SmolLM2 at 8k tokens keeps 30 x (9 + 3) x 8,192 x 64 float16 values: 360 MB of memory-mapped
files, where the maps would take 69 GB. A row costs one (Nk, D) product; a window of the map,
exact or pooled, a pass over its rows a block at a time.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from .capture import CapturedMap, watch
from .weights import head_weights

# float32 weights computed at once for a window: 16 MB.
WINDOW_ELEMENTS = 1 << 22


@dataclass
class StoredLayer:
    """One layer's call: q (H, Nq, D) and k (Hkv, Nk, D) memory-mapped (batch row 0), and
    the variant that call ran (mask, score_mod, similarity, scale, metric)."""

    site: CapturedMap
    q: np.memmap
    k: np.memmap
    variant: dict

    @property
    def shape(self) -> tuple[int, int, int]:
        """(H, Nq, Nk)."""
        return self.q.shape[0], self.q.shape[1], self.k.shape[1]


class QKStore:
    """Every watched layer's q and k, in files under ``folder`` (removed by ``close``)."""

    def __init__(self, folder: Path, layers: list[StoredLayer]):
        self.folder, self.layers = folder, layers

    @classmethod
    def record(cls, model: torch.nn.Module, forward, folder: str | Path, *,
               dtype: torch.dtype = torch.float16) -> QKStore:
        """Run ``forward()`` (one call of ``model``) and keep each layer's q and k in
        ``folder`` (created; it must not exist) as ``dtype``."""
        folder = Path(folder)
        folder.mkdir(parents=True)
        layers: list[StoredLayer] = []

        def keep(site, q: Tensor, k: Tensor, kwargs: dict) -> None:
            if any(layer.site is site for layer in layers):
                raise ValueError(f"{site.name} ran twice in one forward: the store keeps one "
                                 "call per layer")
            files = []
            for name, t in (("q", q[0]), ("k", k[0])):
                path = folder / f"{len(layers):03d}-{name}.bin"
                stored = np.lib.format.open_memmap(path, mode="w+", shape=tuple(t.shape),
                                                   dtype=_numpy(dtype))
                stored[:] = t.to(dtype).cpu().numpy()
                stored.flush()
                files.append(np.load(path, mmap_mode="r"))
            variant = {key: kwargs.get(key) for key in ("mask", "score_mod", "scale", "metric")}
            variant["similarity"] = kwargs.get("similarity", "dot")
            layers.append(StoredLayer(site, files[0], files[1], variant))

        try:
            with watch(model, keep), torch.no_grad():
                forward()
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(folder, layers)

    def close(self) -> None:
        self.layers = []
        shutil.rmtree(self.folder, ignore_errors=True)

    def rows(self, layer: int, heads: list[int], start: int, stop: int) -> Tensor:
        """(len(heads), stop - start, Nk) float32 weights of query rows start..stop-1."""
        stored = self.layers[layer]
        q = torch.from_numpy(np.asarray(stored.q)).float()[None]
        k = torch.from_numpy(np.asarray(stored.k)).float()[None]
        v = stored.variant
        return head_weights(q, k, heads, mask=v["mask"], score_mod=v["score_mod"],
                            similarity=v["similarity"], scale=v["scale"], metric=v["metric"],
                            rows=(start, stop))[0].float()

    def window(self, layer: int, head: int, q_range: tuple[int, int],
               k_range: tuple[int, int], size: int) -> tuple[Tensor, tuple[int, int]]:
        """The weights of rows q0..q1-1 and keys k0..k1-1 of one head, pooled to at most
        ``size`` x ``size`` cells: each cell the mean of a (fq, fk) block of weights (the
        last, ragged blocks over the weights they hold). Returns the grid and (fq, fk);
        (1, 1) is the exact window."""
        (q0, q1), (k0, k1) = q_range, k_range
        fq, fk = math.ceil((q1 - q0) / size), math.ceil((k1 - k0) / size)
        nk = self.layers[layer].shape[2]
        block = max(fq, (WINDOW_ELEMENTS // max(1, nk)) // fq * fq)
        cells = []
        for start in range(q0, q1, block):
            w = self.rows(layer, [head], start, min(q1, start + block))[0][:, k0:k1]
            cells.append(_pool(_pool(w, fq, 0), fk, 1))
        return torch.cat(cells, 0), (fq, fk)


def _pool(w: Tensor, factor: int, dim: int) -> Tensor:
    """Means over consecutive blocks of ``factor`` along ``dim`` (the last block over what it
    holds)."""
    if factor == 1:
        return w
    n = w.shape[dim]
    blocks = math.ceil(n / factor)
    pad = [0, 0] * (w.dim() - 1 - dim) + [0, blocks * factor - n]
    padded = torch.nn.functional.pad(w, pad)
    shape = list(w.shape)
    shape[dim:dim + 1] = [blocks, factor]
    counts = torch.full((blocks,), float(factor))
    counts[-1] = n - (blocks - 1) * factor
    view = [1] * w.dim()
    view[dim] = blocks
    return padded.reshape(shape).sum(dim + 1) / counts.view(view)


def _numpy(dtype: torch.dtype):
    return {torch.float16: np.float16, torch.float32: np.float32}[dtype]
