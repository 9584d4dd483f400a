"""What the neuron view needs: how each score is built, dimension by dimension.

Every similarity is ``scale * kernel(features(q), features(k))`` (``qkv.core.similarity``):
the features are q and k themselves (dot, l2, l1), unit vectors (cosine) or qLᵀ and kLᵀ
(Mahalanobis), and the kernel is a sum over dimensions of q_d·k_d (dot), -(q_d-k_d)² (negative
squared distance) or -|q_d-k_d| (negative L1). So the page stores the features of one layer's
chosen heads, and draws each pair's per-dimension terms from them.

Next to the terms' total it shows the score the layer used, computed here by the library's own
definition (the similarity's ``Pairwise.rows``, its term summed over dimensions) plus the
layer's score modifier, for every stored (query, key) entry. A user-defined term
(``qkv.Similarity``) has its scores stored, but the page draws per-dimension terms only for
the built-in kernels, whose formulas it knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..core.problem import build_problem
from ..core.similarity import PAIRWISE
from .capture import ObservedCall
from .compact import HeadRows


@dataclass
class NeuronLayer:
    """One layer's neuron-view data for its captured heads (batch row 0).

    q_features (h, Nq, F) per captured head; k_features (u, Nk, F) with k_of_head[h] naming
    head h's row (grouped heads share one); scale (h,); kernel: "dot", "neg_sqdist",
    "neg_l1" or "user" (a user-defined term); scores[h] (nnz,) the layer's score for each
    stored entry of head h, in the order of its HeadRows; similarity_scores[h] the
    similarity part alone, when a score modifier adds to it (else None)."""

    layer: int
    similarity: str
    kernel: str
    scale: list[float]
    q_features: np.ndarray
    k_features: np.ndarray
    k_of_head: list[int]
    scores: list[np.ndarray] = field(default_factory=list)
    similarity_scores: list[np.ndarray] | None = None
    _q_parts: list[Tensor] = field(default_factory=list, repr=False)
    _score_parts: list[list[np.ndarray]] = field(default_factory=list, repr=False)
    _sim_parts: list[list[np.ndarray]] = field(default_factory=list, repr=False)


def _features(call: ObservedCall, heads: list[int]):
    m = call.module
    metric = None if m.metric is None else m.metric.detach()
    p = build_problem(call.q, call.k, call.k, mask=call.mask, score_mod=call.score_mod,
                      similarity=m.similarity, scale=m.scale, metric=metric, dropout_p=0.0)
    index = torch.tensor(heads, device=call.q.device)
    q = call.q[:1].index_select(1, index).float()
    k = call.k[:1].index_select(1, index // (p.heads // p.kv_heads)).float()
    metric = p.metric
    if metric is not None:
        metric = metric.float()
        metric = metric.index_select(0, index) if metric.dim() == 3 else metric
    fq, fk = p.similarity.features(q, k, metric)
    scale = p.scale
    if isinstance(scale, Tensor):
        scale = scale.float().expand(p.heads).index_select(0, index) if scale.dim() == 1 \
            else scale.float().expand(len(heads))
    else:
        scale = torch.full((len(heads),), float(scale))
    return p, index, fq[0], fk[0], scale.detach().cpu()


def _pair_scores(p, index, fq, fk, scale, h: int, rows: HeadRows, with_mod: bool) -> np.ndarray:
    """The layer's score for each stored entry of head position h in this call (query rows
    are this call's, as the score modifier sees them, with the call's offset)."""
    q_rows = torch.from_numpy(np.repeat(np.arange(len(rows.counts)), rows.counts)).long()
    cols = torch.from_numpy(rows.cols).long()
    s = p.similarity.pairwise.rows(fq[h][q_rows], fk[h][cols]) * scale[h]
    if with_mod and p.score_mod is not None:
        shape = (1, 1, 1, -1)
        s = p.score_mod(s.view(shape), torch.zeros(1, 1, 1, 1, dtype=torch.long),
                        index[h].view(1, 1, 1, 1).cpu(), q_rows.view(shape), cols.view(shape),
                        p.offset).reshape(-1)
    return s.float().cpu().numpy()


def record(layer: NeuronLayer | None, site_layer: int, heads: list[int], call: ObservedCall,
           new_rows: list[HeadRows]) -> NeuronLayer:
    """Add one call (its stored rows ``new_rows``, one per captured head) to ``layer``."""
    p, index, fq, fk, scale = _features(call, heads)
    if layer is None:
        pairwise = p.similarity.pairwise
        kernel = pairwise.name if PAIRWISE.get(pairwise.name) is pairwise else "user"
        layer = NeuronLayer(site_layer, p.similarity.name, kernel,
                            scale.tolist(), np.zeros(0), np.zeros(0), [])
    layer._q_parts.append(fq.cpu())
    layer._score_parts.append([_pair_scores(p, index, fq, fk, scale, h, r, True)
                               for h, r in enumerate(new_rows)])
    if p.score_mod is not None:
        layer._sim_parts.append([_pair_scores(p, index, fq, fk, scale, h, r, False)
                                 for h, r in enumerate(new_rows)])
    # Keys: the newest call sees every position so far (the KV cache); grouped heads that
    # read one key head get one row.
    unique: list[Tensor] = []
    layer.k_of_head = []
    for h in range(len(heads)):
        found = next((i for i, u in enumerate(unique) if torch.equal(u, fk[h])), None)
        if found is None:
            unique.append(fk[h])
            found = len(unique) - 1
        layer.k_of_head.append(found)
    layer.k_features = torch.stack(unique).cpu().numpy()
    return layer


def finish(layer: NeuronLayer) -> NeuronLayer:
    """Join the calls: q features (h, Nq, F) and per-head score arrays."""
    layer.q_features = torch.cat(layer._q_parts, dim=1).numpy()
    heads = len(layer.k_of_head)
    layer.scores = [np.concatenate([part[h] for part in layer._score_parts])
                    for h in range(heads)]
    if layer._sim_parts:
        layer.similarity_scores = [np.concatenate([part[h] for part in layer._sim_parts])
                                   for h in range(heads)]
    layer._q_parts, layer._score_parts, layer._sim_parts = [], [], []
    return layer
