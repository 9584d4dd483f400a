"""The argument groups of the Triton kernels, built by the host (``function.py``) and read by
the kernels (``kernels.py``, ``backward.py``), and the term kinds as kernel constants.

A kernel takes a few tuples instead of dozens of scalars: each tensor with its strides
(``Mat``), the call's sizes (``Sizes``), the captured tensors (SLOTS, a plain tuple), and two
tuples of compile-time constants, the tiling (``Shape``) and what the variant computes
(``Code``). Inside a kernel a program gathers its own rows once (``QueryRows``,
``KeyRows``, ``BackwardRows``) and hands them to the tile functions whole.

The constants of ``Shape`` and ``Code`` are wrapped in ``tl.constexpr`` by ``constants``:
Triton (3.3 and later) then specializes the kernel on each of them as on a ``tl.constexpr``
parameter, functions included.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import triton.language as tl
from torch import Tensor

from ..lowering import TermKind, WeightsKind

# The term kinds as the kernels compare them (``C.KIND == SQDIST``), from the one enum.
DOT = tl.constexpr(TermKind.DOT.value)
SQDIST = tl.constexpr(TermKind.SQDIST.value)
L1 = tl.constexpr(TermKind.L1.value)
TRACED = tl.constexpr(TermKind.TRACED.value)
# The weightings' kinds likewise (``C.WEIGHTS == STICK``).
SOFTMAX = tl.constexpr(WeightsKind.SOFTMAX.value)
ELEMENTWISE = tl.constexpr(WeightsKind.ELEMENTWISE.value)
SOFTPICK = tl.constexpr(WeightsKind.SOFTPICK.value)
STICK = tl.constexpr(WeightsKind.STICK.value)


class Mat(NamedTuple):
    """A (B|1, H|1, N, ·) tensor: its pointer and its batch, head and row strides (0 along a
    broadcast batch or head dim)."""

    ptr: object
    sb: object
    sh: object
    sm: object


class Sizes(NamedTuple):
    """The call's run-time scalars."""

    H: object  # query heads
    NQ: object
    NK: object
    OFFSET: object  # Nk - Nq: bottom-right causal alignment
    SEED: object  # dropout's Philox seed
    DROPOUT_P: object


class Shape(NamedTuple):
    """How a launch tiles its problem (constants)."""

    GROUP: object  # query heads per key head
    D: object
    DV: object
    D_PAD: object  # D and DV padded to a power of two, at least 16
    DV_PAD: object
    BLOCK_M: object  # query rows per tile
    BLOCK_N: object  # keys per tile
    BLOCK_D: object  # columns per chunk of the chunked terms
    PRECISION: object  # tl.dot's input_precision: "ieee" for float32 inputs


class Code(NamedTuple):
    """What the variant computes (constants): its term's kind, its generated functions (see
    kernelgen/triton.py) and which parts run."""

    KIND: object  # a TermKind value
    PRODUCTS: object  # the scores are matrix products (TermKind.products)
    HAS_MASK: object
    MASK_FN: object
    HAS_MOD: object
    MOD_FN: object
    MOD_BWD_FN: object
    TERM_FN: object  # a traced term, its derivatives and the gradients of its tensors
    TERM_DQ_FN: object
    TERM_DK_FN: object
    TERM_GRAD_FN: object
    DROPOUT: object
    SLOT_GRAD: object  # the captured tensors' gradients are wanted (dQ kernel)
    SCALE_GRAD: object  # the scale's gradient is wanted (dQ kernel)
    WEIGHTS: object  # a WeightsKind value: softmax's kernels, or those of ``weighted.py``
    EPS: object  # softpick's eps
    INCLUDE_SELF: object  # stick-breaking's include_self


class QueryRows(NamedTuple):
    """A program's tile of query rows (forward, weights and dQ kernels)."""

    q: object
    qn: object  # their squared norms (SQDIST)
    Qb: object  # the (b, h) matrices of Q, K and V, and the key norms
    Kb: object
    Vb: object
    KNb: object
    offs_m: object
    offs_d: object
    offs_v: object
    q_idx: object  # positions, clamped into the matrix
    scale: object
    b: object
    h: object
    pid_bh: object
    sqm: object  # row strides
    skn: object
    svn: object


class KeyRows(NamedTuple):
    """A dK/dV program's tile of keys and one query head of their group."""

    k: object
    kn: object
    v: object
    Kb: object
    DKb: object
    offs_n: object
    offs_d: object
    offs_v: object
    b: object
    h: object
    bh: object  # b·H + h
    scale: object
    Qb: object
    DOb: object
    LSEb: object
    DELTAb: object
    QNb: object
    sqm: object
    skn: object
    sdm: object


class BackwardRows(NamedTuple):
    """What the dQ kernel's tiles read besides ``QueryRows``."""

    do: object
    lse: object
    delta: object
    DQb: object
    GRADS: object  # the captured tensors' gradient buffers


class WeightedRows(NamedTuple):
    """What the dQ tiles of ``weighted.py`` read besides ``QueryRows``: as ``BackwardRows``,
    and the (b, kv head) rows of fp32 dK and dV, into which stick-breaking's tiles add."""

    do: object
    lse: object
    delta: object
    DQb: object
    DKb: object
    DVb: object
    GRADS: object


def mat(t: Tensor) -> Mat:
    """``t`` with its (batch, head, row) strides; 0 along a broadcast (size-1) batch or head."""
    batch, heads = t.shape[:2]
    sb, sh, sm = t.stride()[:3]
    return Mat(t, 0 if batch == 1 else sb, 0 if heads == 1 else sh, sm)


def constants(group: type, **values):
    """A ``Shape`` or ``Code`` of ``values`` (every field, by name, in order), each a
    ``tl.constexpr``: made once per distinct set of values and shared, as it is immutable
    (making one would cost a few microseconds of every launch)."""
    if tuple(values) != group._fields:
        raise TypeError(f"{group.__name__} takes {', '.join(group._fields)}, in that order")
    return _constants(group, tuple(values.values()))


@functools.lru_cache(maxsize=1024)
def _constants(group: type, values: tuple):
    return group(*map(tl.constexpr, values))
