"""The kinds of pairwise term the engines have code of their own for, as one enum.

Every engine's kernels branch on ``TermKind``: the C sources get its values as compile flags
(``c_defines``), the Triton kernels as a constexpr. A new fast built-in term is one value
here plus one branch per engine; any other term is TRACED: the engines generate its code from
its definition (``kernelgen``).
"""

from __future__ import annotations

import enum

from ..core.similarity import DOT, NEG_L1, NEG_SQDIST


class TermKind(enum.IntEnum):
    """How an engine computes Σ_d term(q_d, k_d)."""

    DOT = 0  # q·k: matrix products
    SQDIST = 1  # -‖q-k‖² = 2q·k - ‖q‖² - ‖k‖²: matrix products and row norms
    L1 = 2  # -‖q-k‖₁: no product form, loops over D
    TRACED = 3  # any other term: code generated from its definition

    @property
    def products(self) -> bool:
        """Whether the scores are matrix products (tensor cores, BLAS) of the features."""
        return self in (TermKind.DOT, TermKind.SQDIST)


# The built-in terms by definition (``Pairwise.term``, which a variant keeps through its trip
# across a custom op).
_KINDS = {DOT.term: TermKind.DOT, NEG_SQDIST.term: TermKind.SQDIST, NEG_L1.term: TermKind.L1}


def term_kind(pair) -> TermKind:
    """The kind of ``pair``'s term (a ``similarity.Pairwise``): a built-in one, or TRACED."""
    return _KINDS.get(pair.term, TermKind.TRACED)


def c_defines() -> list[str]:
    """The compiler flags that give C sources the kinds by name: -DQKV_TERM_DOT=0, ..."""
    return [f"-DQKV_TERM_{kind.name}={kind.value}" for kind in TermKind]
