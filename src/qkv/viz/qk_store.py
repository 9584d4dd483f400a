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
        """Run ``forward()`` (a call of ``model``, or a prompt and then generated tokens
        through its KV cache) and keep each layer's q and k in ``folder`` (created; it must
        not exist) as ``dtype``. Each call's q rows follow the earlier calls' and its k holds
        every key so far (the cache), so the store keeps all rows against the last call's
        keys."""
        folder = Path(folder)
        folder.mkdir(parents=True)
        calls: dict[str, dict] = {}

        def keep(site, q: Tensor, k: Tensor, kwargs: dict, lse) -> None:  # lse: not needed
            seen = calls.setdefault(site.name, {"site": site, "q": [], "rows": 0})
            if seen["q"] and not _same_rule(seen["variant"]["mask"], kwargs.get("mask")):
                raise ValueError(f"{site.name}: a later call's mask is not the same rule; the "
                                 "store keeps one variant per layer")
            if seen["rows"] + q.shape[2] != k.shape[2]:
                raise ValueError(f"{site.name}: a call's queries do not follow the earlier "
                                 "calls' (the store keeps self-attention through a KV cache)")
            seen["q"].append(q[0].to(dtype).cpu())
            seen["rows"] += q.shape[2]
            seen["k"] = k[0].to(dtype).cpu()
            seen["variant"] = {key: kwargs.get(key) for key in ("mask", "score_mod", "scale",
                                                                 "metric")}
            seen["variant"]["similarity"] = kwargs.get("similarity", "dot")
            seen["variant"]["weighting"] = kwargs.get("weighting", "softmax")

        try:
            with watch(model, keep), torch.no_grad():
                forward()
            layers = [StoredLayer(c["site"], _write(folder, i, "q", torch.cat(c["q"], 1)),
                                  _write(folder, i, "k", c["k"]), c["variant"])
                      for i, c in enumerate(calls.values())]
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(folder, layers)

    def close(self) -> None:
        self.layers = []
        shutil.rmtree(self.folder, ignore_errors=True)

    def _float32(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's q (1, H, Nq, D) and k (1, Hkv, Nk, D): float32 copies read from the
        mapped files (writable, as torch wants), once per request."""
        stored = self.layers[layer]
        return (torch.from_numpy(stored.q.astype(np.float32))[None],
                torch.from_numpy(stored.k.astype(np.float32))[None])

    def _weights(self, layer: int, q: Tensor, k: Tensor, heads: list[int], start: int,
                 stop: int) -> Tensor:
        v = self.layers[layer].variant
        return head_weights(q, k, heads, mask=v["mask"], score_mod=v["score_mod"],
                            similarity=v["similarity"], scale=v["scale"], metric=v["metric"],
                            rows=(start, stop), weighting=v["weighting"])[0].float()

    def rows(self, layer: int, heads: list[int], start: int, stop: int) -> Tensor:
        """(len(heads), stop - start, Nk) float32 weights of query rows start..stop-1."""
        return self._weights(layer, *self._float32(layer), heads, start, stop)

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
        q, k = self._float32(layer)
        cells = []
        for start in range(q0, q1, block):
            w = self._weights(layer, q, k, [head], start, min(q1, start + block))[0][:, k0:k1]
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


def _same_rule(a, b) -> bool:
    """Whether two masks are the same rule for every shape (None, or equal layout keys)."""
    if a is None or b is None:
        return a is b
    return a.layout_key() is not None and a.layout_key() == b.layout_key()


def _write(folder: Path, index: int, name: str, t: Tensor) -> np.memmap:
    path = folder / f"{index:03d}-{name}.npy"
    stored = np.lib.format.open_memmap(path, mode="w+", shape=tuple(t.shape),
                                       dtype=_numpy(t.dtype))
    stored[:] = t.numpy()
    stored.flush()
    del stored
    return np.load(path, mmap_mode="r")


def _numpy(dtype: torch.dtype):
    return {torch.float16: np.float16, torch.float32: np.float32}[dtype]
