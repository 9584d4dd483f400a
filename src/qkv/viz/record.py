"""Stream captured maps into what a page stores, one layer at a time.

``Recorder`` is a ``capture(on_weights=...)`` callback. Each forward call of each captured
layer hands it that call's (B, h, Nq, Nk) float32 weights; it keeps batch row 0 as compact
rows and summary sums (``qkv.viz.compact``), the neuron-view data of chosen layers
(``qkv.viz.neuron``), and, for stacks that ask for it, the attention rollout so far (one
(N, N) product), and lets the float32 maps go. So a 30-layer model at 2,048 tokens never holds
more than one layer's maps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor

from ..nn.differential import DifferentialAttention
from .capture import CapturedMap, ObservedCall
from .compact import RowsBuilder, join_rows
from .neuron import NeuronLayer, finish, record
from .page import PageView
from .rollout import rollout_step

NEURON_BUDGET = 8 << 20  # bytes of float32 q and k features kept by default for the neuron view


def neuron_layers_within(budget: int, layers: list[int], heads: int, kv_heads: int,
                         tokens: int, head_dim: int) -> list[int]:
    """The first of ``layers`` whose q and k features fit ``budget`` bytes (at least one)."""
    per_layer = (heads + kv_heads) * tokens * head_dim * 4
    return list(layers[: max(1, budget // max(1, per_layer))])


@dataclass
class _Site:
    builder: RowsBuilder
    neuron: NeuronLayer | None = None
    blocks: int = 0  # row blocks of the current call added so far


class Recorder:
    """The ``on_weights`` callback: see the module docstring.

    threshold, max_per_row: what rows keep (``compact.compress_head``); neuron_layers: layer
    indices whose neuron data is kept; rollout_stacks: stacks rolled out as they are captured
    (their layers must arrive first to last, in one forward call)."""

    def __init__(self, threshold: float, max_per_row: int | None, neuron_layers=(),
                 rollout_stacks=()):
        self.threshold, self.max_per_row = threshold, max_per_row
        self.neuron_layers = set(neuron_layers)
        self.rollout_stacks = set(rollout_stacks)
        self.sites: dict[str, _Site] = {}
        self.rollouts: dict[str, Tensor] = {}

    def __call__(self, site: CapturedMap, weights: Tensor, call: ObservedCall) -> None:
        w = weights[0].float()
        entry = self.sites.get(site.name)
        if entry is None:
            entry = self.sites[site.name] = _Site(RowsBuilder(w.shape[0], self.threshold,
                                                              self.max_per_row))
        done = sum(len(part[0].counts) for part in entry.builder.parts)
        # Self-attention rows are bottom-right aligned on the keys (the KV cache); a
        # cross-attention query's position is its row number. w may be a block of the call's
        # rows, starting at call.first_row.
        nq = call.q.shape[2]
        first = done if site.is_cross else w.shape[2] - nq + call.first_row
        entry.builder.add(w, first)
        entry.blocks += 1
        if call.first_row + w.shape[1] < nq:
            return  # more blocks of this call to come
        blocks, entry.blocks = entry.builder.parts[-entry.blocks:], 0
        # The neuron view explains one score per query-key pair; a differential head's map
        # comes from two, so it has none.
        if site.layer in self.neuron_layers and not isinstance(call.module,
                                                               DifferentialAttention):
            entry.neuron = record(entry.neuron, site.layer, site.heads, call,
                                  join_rows(blocks))
        if site.stack in self.rollout_stacks and not site.is_cross:
            self.rollouts[site.stack] = rollout_step(self.rollouts.get(site.stack), w[None])

    def view(self, sites: list[CapturedMap], name: str, query_tokens: list[str],
             key_tokens: list[str], *, first_generated: int | None = None) -> PageView:
        """The page view of one stack's captured layers (in layer order)."""
        entries = [self.sites[s.name] for s in sites]
        rollout = self.rollouts.get(sites[0].stack) if not sites[0].is_cross else None
        return PageView(
            name, "cross" if sites[0].is_cross else "self", query_tokens, key_tokens,
            [s.layer for s in sites], list(sites[0].heads),
            rows=[e.builder.rows() for e in entries],
            summary=np.stack([e.builder.summary.means() for e in entries]),
            rollout=None if rollout is None else rollout[0].float(),
            neurons=[finish(e.neuron) for e in entries if e.neuron is not None],
            first_generated=first_generated,
        )
