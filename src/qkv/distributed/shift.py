"""Masks and score modifiers of the whole sequence, evaluated on one (query chunk, key chunk).

A rank computes attention between a chunk of its queries, global positions
``q_start ... q_start + nq - 1``, and a chunk of keys, ``kv_start ... kv_start + nk - 1``. The
engine sees a small (nq, nk) problem with local indices; these wrappers add the starts back
and pass the offset of the whole problem (``Nk - Nq`` of the global sequence), so causal,
windows, segments, graph edges and ALiBi mean what they mean on the whole sequence.

Instance attributes are plain ints and the wrapped mask / modifier only (the core makes
Mask and ScoreMod subclasses pytree nodes for torch.compile).
"""

from __future__ import annotations

from qkv.core.masks import AndMask, CustomMask, Mask, NotMask, OrMask
from qkv.core.scores import ScoreMod


class ShiftedMask(Mask):
    """``inner`` evaluated at global positions (q_idx + q_start, kv_idx + kv_start) of a
    global problem of ``nq_global`` queries by ``nk_global`` keys."""

    def __init__(self, inner: Mask, q_start: int, kv_start: int, nq_global: int, nk_global: int):
        self.inner = inner
        self.q_start, self.kv_start = q_start, kv_start
        self.nq_global, self.nk_global = nq_global, nk_global

    def check(self, batch, heads, nq, nk):
        self.inner.check(batch, heads, self.nq_global, self.nk_global)

    def tensors(self):
        return self.inner.tensors()

    def mask_mod(self, b, h, q_idx, kv_idx, offset):
        return self.inner.mask_mod(b, h, q_idx + self.q_start, kv_idx + self.kv_start,
                                   self.nk_global - self.nq_global)

    def tile_states(self, batch, heads, nq, nk, block_q, block_k, device=None):
        """Where the chunk starts on a tile boundary and the inner mask classifies tiles
        without evaluating its rule, the global tiles sliced (a local tile at the end of a
        chunk covers part of its global tile: EMPTY and FULL stay true on the part). Else
        the rule is evaluated on this chunk only, never on the whole sequence."""
        structured = type(self.inner).tile_states not in (Mask.tile_states,
                                                          CustomMask.tile_states)
        if structured and self.q_start % block_q == 0 and self.kv_start % block_k == 0:
            states = self.inner.tile_states(batch, heads, self.nq_global, self.nk_global,
                                            block_q, block_k, device)
            i0, j0 = self.q_start // block_q, self.kv_start // block_k
            return states[:, :, i0:i0 + -(-nq // block_q), j0:j0 + -(-nk // block_k)]
        grid = batch * heads if isinstance(self.inner, CustomMask) else 1
        return Mask.tile_states(self, batch, heads, nq, nk, block_q, block_k, device, grid=grid)

    def __repr__(self) -> str:
        return repr(self.inner)


def shift_mask(mask: Mask | None, q_start: int, kv_start: int, nq_global: int,
               nk_global: int) -> Mask | None:
    """``mask`` at global positions; &, | and ~ are rebuilt around shifted parts so that each
    part keeps its own fast ``tile_states``."""
    if mask is None:
        return None
    if isinstance(mask, (AndMask, OrMask)):
        parts = (shift_mask(m, q_start, kv_start, nq_global, nk_global) for m in (mask.a, mask.b))
        return type(mask)(*parts)
    if isinstance(mask, NotMask):
        return NotMask(shift_mask(mask.inner, q_start, kv_start, nq_global, nk_global))
    return ShiftedMask(mask, q_start, kv_start, nq_global, nk_global)


class ShiftedScoreMod(ScoreMod):
    """``inner`` evaluated at global positions, with the global offset ``Nk - Nq``."""

    def __init__(self, inner: ScoreMod, q_start: int, kv_start: int, offset_global: int):
        self.inner = inner
        self.q_start, self.kv_start, self.offset_global = q_start, kv_start, offset_global

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        return self.inner(score, b, h, q_idx + self.q_start, kv_idx + self.kv_start,
                          self.offset_global)

    def tensors(self):
        return self.inner.tensors()

    def check_heads(self, heads: int) -> None:
        self.inner.check_heads(heads)

    def __repr__(self) -> str:
        return repr(self.inner)
