"""A request lowered once into what every engine reads.

``qkv.attention`` validates a request into a ``Problem`` (the math package). An engine that
runs it lowers it here, once per call: the similarity's features computed, the scale folded
into them where the term allows, and the variant as one ``Lowered`` object: the pairwise term
and its kind (``TermKind``), the score modifier, the mask and the scale that is left. The
forward, the backward and the custom op that carries them between the two (``ops``) read
that one object; each engine adds only its own tiling.

The term's kind is one enum (``TermKind``): every engine's kernels branch on it, the C sources
get its values as compile flags (``c_defines``), the Triton kernels as a constexpr. A new fast
built-in term is one value here plus one branch per engine; any other term is TRACED: the
engines generate its code from its definition (``kernelgen``).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from torch import Tensor

from ..core.problem import Problem
from ..core.reference import accumulation_dtype
from ..core.similarity import DOT, NEG_L1, NEG_SQDIST
from ..core.structure import Node
from ..core.weighting import SOFTMAX, Carry, Softmax, Softpick, StickBreaking, Weighting


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


class WeightsKind(enum.IntEnum):
    """How an engine's hand-written loops turn a tile's scores into weights: one branch per
    kind in each engine that has them; a weighting with no kind runs where the loops derive
    from its definition alone (``cpu/carries.py``)."""

    SOFTMAX = 0
    ELEMENTWISE = 1  # Carry.NONE: the weighting's function ends the modifier's loops
    SOFTPICK = 2
    STICK = 3


_WEIGHTS = {Softmax: WeightsKind.SOFTMAX, Softpick: WeightsKind.SOFTPICK,
            StickBreaking: WeightsKind.STICK}


def weights_kind(variant: Lowered) -> WeightsKind | None:
    """The kind of ``variant``'s weighting, or None for one without hand-written loops (a
    subclass of a built-in is its own weighting, and has none)."""
    if variant.carry is Carry.NONE:
        return WeightsKind.ELEMENTWISE
    return _WEIGHTS.get(type(variant.normalizer))


def c_defines() -> list[str]:
    """The compiler flags that give C sources the kinds by name: -DQKV_TERM_DOT=0, ...,
    -DQKV_WEIGHTS_SOFTMAX=0, ..."""
    return ([f"-DQKV_TERM_{kind.name}={kind.value}" for kind in TermKind]
            + [f"-DQKV_WEIGHTS_{kind.name}={kind.value}" for kind in WeightsKind])


class Lowered(Node):
    """What the kernels read besides q, k and v.

    - ``pair``: the pairwise term (``similarity.Pairwise``), and ``term``, its kind;
    - ``score_mod`` and ``mask``: the core's objects, or None;
    - ``scale``: None when folded into the features, else a float or a tensor of shape (H,)
      in the accumulation dtype, for every engine (``scale_bhqk`` is its view on score
      tiles (B, H, ·, ·));
    - ``carry``: the row statistic of the weighting (``core.weighting.Carry``), and
      ``normalizer``, the weighting that carries it (None for ``Carry.NONE``, whose
      elementwise function ends ``score_mod``: ``lower``).
    A pytree node: its leaves are the tensors it reads, which the custom ops carry."""

    def __init__(self, pair, score_mod, mask, scale, normalizer: Weighting | None = SOFTMAX):
        self.pair, self.score_mod, self.mask, self.scale = pair, score_mod, mask, scale
        self.normalizer = normalizer
        self.carry: Carry = Carry.NONE if normalizer is None else normalizer.carry
        self.term: TermKind = term_kind(pair)

    @property
    def scale_bhqk(self) -> float | Tensor | None:
        """The scale broadcastable to scores (B, H, Nq, Nk): a tensor viewed (1, H, 1, 1)."""
        return self.scale.view(1, -1, 1, 1) if isinstance(self.scale, Tensor) else self.scale

    @property
    def is_softmax(self) -> bool:
        return self.normalizer is not None and self.normalizer.is_softmax

    def without_scale(self) -> Lowered:
        """The same variant with its scale applied elsewhere (a traced term's loops)."""
        return Lowered(self.pair, self.score_mod, self.mask, None, self.normalizer)


class Lowering(NamedTuple):
    """A call lowered for the engines: the scores' features fq (B, H, Nq, D) and
    fk (B, Hk, Nk, D), v (B, Hk, Nk, Dv), and the variant."""

    fq: Tensor
    fk: Tensor
    v: Tensor
    variant: Lowered


def lower(p: Problem, *, inputs_dtype: bool = False, fold_scale: bool = True) -> Lowering:
    """``p`` lowered once for an engine.

    Args:
        inputs_dtype: keep q, k, v (and the metric) in their own dtype, for kernels that
            accumulate in registers (Triton); else cast them to the accumulation dtype.
        fold_scale: fold the scale into the features where the term can absorb it
            (``Pairwise.fold_scale``). A learnable scale folded into the features gets its
            gradient from autograd through that product (O(N·D)), and the tiles run as for a
            number: no autograd graph per tile.

    A scale left to the kernels is a float or an (H,) tensor in the accumulation dtype."""
    acc = accumulation_dtype(p.q.dtype)
    dtype = p.q.dtype if inputs_dtype else acc
    q, k, v = (t.to(dtype) for t in (p.q, p.k, p.v))
    metric = None if p.metric is None else p.metric.to(dtype)
    fq, fk = p.similarity.features(q, k, metric)
    scale = p.scale
    folded = None
    if fold_scale and p.similarity.pairwise.fold_scale is not None:
        folded = p.similarity.pairwise.fold_scale(
            fq, fk, p.scale_tensor().to(acc) if isinstance(scale, Tensor) else scale)
    if folded is not None:
        (fq, fk), scale = folded, None
    if fk.shape[1] != v.shape[1]:  # a per-head metric gave k one feature map per query head
        v = v.repeat_interleave(fk.shape[1] // v.shape[1], dim=1)
    if isinstance(scale, Tensor):
        scale = scale.to(acc).reshape(-1).expand(p.heads).contiguous()
    return Lowering(fq, fk, v, lowered_variant(p, scale))


def lowered_variant(p: Problem, scale: float | Tensor | None) -> Lowered:
    """``p``'s variant with ``scale`` (see ``Lowered``), its features not computed."""
    score_mod, normalizer = weighted_mod(p)
    return Lowered(p.similarity.pairwise, score_mod, p.mask, scale, normalizer)


def weighted_mod(p: Problem):
    """(score modifier, normalizer) of ``p`` as ``Lowered`` holds them: an elementwise
    weighting's function is applied after the modifier, as one more modifier that the engines
    trace (derivative included); the others keep the modifier and carry their weighting."""
    if p.weighting.carry is not Carry.NONE:
        return p.score_mod, p.weighting
    fn = p.weighting.score_fn(p.nk)
    if fn is None:
        return p.score_mod, None
    return (fn if p.score_mod is None else p.score_mod.then(fn)), None
