"""The pairwise terms the Triton kernels have code of their own for (no Triton import)."""

from __future__ import annotations

from ...core.similarity import DOT, NEG_L1, NEG_SQDIST

MAX_HEAD_DIM = 256
# The pairwise terms the kernels have code of their own for, by definition
# (``Pairwise.term``), and their KERNEL ids; TRACED runs the generated ``term_fn`` of any
# other term.
KERNELS_OF_TERMS = {DOT.term: 0, NEG_SQDIST.term: 1, NEG_L1.term: 2}
TRACED = 3


def kernel_id(pair) -> int | None:
    """The KERNEL id of ``pair``'s own Triton code, or None: its term is traced."""
    return KERNELS_OF_TERMS.get(pair.term)
