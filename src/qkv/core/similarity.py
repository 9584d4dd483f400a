"""Similarities: how a query and a key are compared before the softmax.

A similarity is one object, ``Similarity``, that every engine asks. It holds:
- ``features(q, k, metric)``: an O(N·D) map of q and k (identity, unit vectors for cosine,
  q -> qLᵀ for Mahalanobis), run under ordinary autograd by every engine;
- ``pairwise``: the pairwise term, defined by one per-dimension function ``term(q_d, k_d)``
  that is summed over d. Next to that definition, ``Pairwise`` registers the fast forms that
  exist for it: a torch form on whole tiles (``matrix``: a matrix product, the norm expansion,
  ``cdist``) and its derivative on tiles by hand (``tile_grads``). Which terms have kernel
  code of their own is each engine's table (keyed by ``term``); a term without (a user's)
  runs through ``pairwise_sum``, chunked and differentiated by autograd, and the engines
  generate their code from the same function (``engines.kernelgen``);
- ``default_scale(D)``.
The score is ``scale * Σ_d term(features(q)_d, features(k)_d)``.

Similarities are registered by name (``register_similarity``), so that modules and model
configs can name a user's similarity as they name the built-in ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from .scores import captured_tensors
from .structure import Node

# The broadcast (..., m, n, D) block that ``pairwise_sum`` evaluates at once, in elements: a
# megabyte in float32, so that its several elementwise passes stay in cache.
_CHUNK_ELEMENTS = 1 << 18


def dot_scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
    """(..., Nq, D), (..., Nk, D) -> (..., Nq, Nk): q·k. Each fast form writes into ``out``
    (contiguous, of the result's shape) when given: engines reuse one buffer per worker."""
    return torch.matmul(q, k.transpose(-1, -2), out=out)


def lift_sqdist(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """(..., Nq, D), (..., Nk, D) -> [q, ‖q‖², 1] and [2k, -1, -‖k‖²] (..., D + 2), whose dot
    product is the norm expansion 2q·k - ‖q‖² - ‖k‖² = -‖q-k‖²."""
    ones_q, ones_k = torch.ones_like(q[..., :1]), torch.ones_like(k[..., :1])
    qa = torch.cat([q, (q * q).sum(-1, keepdim=True), ones_q], dim=-1)
    ka = torch.cat([2 * k, -ones_k, -(k * k).sum(-1, keepdim=True)], dim=-1)
    return qa, ka


def nonpositive_dot_scores(qa: Tensor, ka: Tensor, out: Tensor | None = None) -> Tensor:
    """qa·ka of ``lift_sqdist``'s features, clamped at 0: only rounding makes it positive."""
    scores = dot_scores(qa, ka, out)
    return scores.clamp(max=0) if out is None else scores.clamp_(max=0)


def neg_sqdist_scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
    """-‖q-k‖² by the norm expansion (the form fused engines use), as one matrix product of
    the lifted features: a single pass over the (Nq, Nk) scores instead of four."""
    return nonpositive_dot_scores(*lift_sqdist(q, k), out=out)


def neg_l1_scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
    """-‖q-k‖₁. No matrix-multiply form exists; cdist sums |q-k| without materializing the
    (..., Nq, Nk, D) differences (about 10x faster than broadcasting, forward and backward)."""
    return torch.neg(torch.cdist(q, k, p=1), out=out)


def _flat3(t: Tensor) -> Tensor:
    """(B, X, n, d) -> (B·X, n, d) as a view (never a copy: results are accumulated into it)."""
    return t.view(-1, *t.shape[2:])


def dot_tile_grads(ds: Tensor, q: Tensor, k: Tensor, dq: Tensor, dk: Tensor) -> None:
    """dq += ds·k, dk += dsᵀ·q for ds = d(loss)/d(q·kᵀ) (B, X, m, n), q (B, X, m, D),
    k (B, X, n, D); dq and dk contiguous."""
    d3, q3, k3 = ds.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1)
    _flat3(dq).baddbmm_(d3, k3)
    _flat3(dk).baddbmm_(d3.transpose(1, 2), q3)


def neg_sqdist_tile_grads(ds: Tensor, q: Tensor, k: Tensor, dq: Tensor, dk: Tensor) -> None:
    """For 2q·k - ‖q‖² - ‖k‖²: dq += 2(ds·k - rowsum(ds)·q), dk += 2(dsᵀ·q - colsum(ds)·k).
    The clamp at 0 only touches pairs with q ≈ k up to rounding, where these terms vanish,
    so it is not undone."""
    d3, q3, k3 = ds.flatten(0, 1), q.flatten(0, 1), k.flatten(0, 1)
    _flat3(dq).baddbmm_(d3, k3, alpha=2.0)
    _flat3(dk).baddbmm_(d3.transpose(1, 2), q3, alpha=2.0)
    dq.sub_(ds.sum(-1, keepdim=True) * q, alpha=2.0)
    dk.sub_(ds.sum(-2).unsqueeze(-1) * k, alpha=2.0)


class _PairwiseSum(torch.autograd.Function):
    """Σ_d term(q_d, k_d) for every (query, key) pair, a block of keys at a time: the
    (..., m, n, D) broadcast is never held whole. The backward recomputes each block under
    autograd, so the term's derivative comes from its definition, and reaches the tensors
    the term reads (``tensors``, in the order given)."""

    @staticmethod
    def forward(ctx, term, q, k, *tensors):
        out = q.new_empty(*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]), q.shape[-2],
                          k.shape[-2])
        for rows, cols in _blocks(q, k):
            qb, kb = q[..., rows, None, :], k[..., None, cols, :]
            out[..., rows, cols] = term(qb, kb).to(out.dtype).sum(-1)
        ctx.term, ctx.tensors = term, tensors
        ctx.save_for_backward(q, k)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, ds):
        q, k = ctx.saved_tensors
        wanted = [t for t in ctx.tensors if t.requires_grad]
        dq, dk = torch.zeros_like(q), torch.zeros_like(k)
        sums: list[Tensor | None] = [None] * len(wanted)
        for rows, cols in _blocks(q, k):
            with torch.enable_grad():
                qb = q[..., rows, None, :].detach().requires_grad_()
                kb = k[..., None, cols, :].detach().requires_grad_()
                part = ctx.term(qb, kb).to(ds.dtype)
                grads = torch.autograd.grad(part, (qb, kb, *wanted),
                                            ds[..., rows, cols, None].expand_as(part),
                                            allow_unused=True)
            if grads[0] is not None:
                dq[..., rows, :] += grads[0].sum(-2).sum_to_size(dq[..., rows, :].shape)
            if grads[1] is not None:
                dk[..., cols, :] += grads[1].sum(-3).sum_to_size(dk[..., cols, :].shape)
            sums = [s if g is None else g if s is None else s + g
                    for s, g in zip(sums, grads[2:], strict=True)]
        found = iter(sums)
        return (None, dq, dk, *(next(found) if t.requires_grad else None for t in ctx.tensors))


def _blocks(q: Tensor, k: Tensor):
    """(row slice, key slice) blocks whose broadcast (..., m, n, D) fits _CHUNK_ELEMENTS."""
    lead = math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
    m, n, d = q.shape[-2], k.shape[-2], max(1, q.shape[-1])
    per_row = lead * d * min(n, 64)
    rows = m if per_row * m <= _CHUNK_ELEMENTS else max(1, _CHUNK_ELEMENTS // per_row)
    cols = max(1, _CHUNK_ELEMENTS // (lead * d * rows))
    for r0 in range(0, m, rows):
        for c0 in range(0, n, cols):
            yield slice(r0, min(m, r0 + rows)), slice(c0, min(n, c0 + cols))


def pairwise_sum(term: Callable, q: Tensor, k: Tensor, tensors=()) -> Tensor:
    """(..., Nq, D), (..., Nk, D) -> (..., Nq, Nk): Σ_d term(q_d, k_d) from the definition
    alone, O(block) memory, differentiable in q, k and ``tensors`` (what ``term`` reads)."""
    return _PairwiseSum.apply(term, q, k, *tensors)


@dataclass(frozen=True, eq=False)
class Pairwise(Node):
    """A pairwise term Σ_d term(q_d, k_d) and the fast forms registered for it.

    ``term`` is elementwise: it gets broadcast tensors whose last dim is d, and tensors it
    reads broadcast against them (shape () for a scalar, (D,) for one value per dimension).
    """

    name: str
    term: Callable[[Tensor, Tensor], Tensor]
    matrix: Callable[..., Tensor] | None = None  # torch form on tiles: (q, k, out=None)
    tile_grads: Callable[..., None] | None = None  # its derivative by hand, see dot_tile_grads
    # The term's scores as ``lifted_matrix`` of the features ``lift(q, k)``, which a tiled
    # engine computes once per call (O(N·D)) rather than once per tile (L2's norm expansion).
    lift: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
    lifted_matrix: Callable[..., Tensor] | None = None
    # (q, k, scale) -> features whose scores are scale times q and k's, or None where the
    # term cannot absorb that scale: a tiled engine folds it in once per call (O(N·D))
    # instead of multiplying every tile of scores. ``scale`` is a number or a tensor
    # broadcastable to q (a learnable temperature, per head as (1, H, 1, 1)).
    fold_scale: Callable[[Tensor, Tensor, float | Tensor],
                         tuple[Tensor, Tensor] | None] | None = None

    def tensors(self) -> tuple[Tensor, ...]:
        """Floating-point tensors the term reads: gradients reach them."""
        return tuple(t for t in captured_tensors(self.term) if t.is_floating_point())

    def scores(self, q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
        """(..., Nq, D), (..., Nk, D) -> (..., Nq, Nk); in ``out`` when the fast form can."""
        if self.matrix is not None:
            return self.matrix(q, k, out=out)
        return pairwise_sum(self.term, q, k, self.tensors())

    def rows(self, q: Tensor, k: Tensor) -> Tensor:
        """(..., D), (..., D) -> (...): the term of matching rows (the pairwise diagonal)."""
        return self.term(q, k).sum(-1)


def _fold_into_q(q: Tensor, k: Tensor, scale: float | Tensor) -> tuple[Tensor, Tensor]:
    return q * scale, k  # s·(q·k) = (s·q)·k, for a learnable (per-head) tensor s as well


def _fold_sqrt(q: Tensor, k: Tensor, scale: float | Tensor) -> tuple[Tensor, Tensor] | None:
    if isinstance(scale, Tensor) or scale <= 0:  # a tensor's sign is not known here
        return None
    root = math.sqrt(scale)  # s·‖q-k‖² = ‖√s·q - √s·k‖² for s > 0
    return q * root, k * root


def _fold_both(q: Tensor, k: Tensor, scale: float | Tensor) -> tuple[Tensor, Tensor] | None:
    if isinstance(scale, Tensor) or scale <= 0:  # a tensor's sign is not known here
        return None
    return q * scale, k * scale  # s·|q-k| = |s·q - s·k| for s > 0


DOT = Pairwise("dot", lambda q, k: q * k, dot_scores, dot_tile_grads, fold_scale=_fold_into_q)
NEG_SQDIST = Pairwise("neg_sqdist", lambda q, k: -(q - k).square(), neg_sqdist_scores,
                      neg_sqdist_tile_grads, lift_sqdist, nonpositive_dot_scores, _fold_sqrt)
# L1's derivative on tiles runs in the fused engine's C loops (cdist's autograd without them).
NEG_L1 = Pairwise("neg_l1", lambda q, k: -(q - k).abs(), neg_l1_scores, fold_scale=_fold_both)
PAIRWISE = {p.name: p for p in (DOT, NEG_SQDIST, NEG_L1)}


def _identity(q: Tensor, k: Tensor, metric: Tensor | None) -> tuple[Tensor, Tensor]:
    return q, k


def _unit(q: Tensor, k: Tensor, metric: Tensor | None) -> tuple[Tensor, Tensor]:
    return F.normalize(q, dim=-1, eps=1e-12), F.normalize(k, dim=-1, eps=1e-12)


def _mahalanobis(q: Tensor, k: Tensor, metric: Tensor | None) -> tuple[Tensor, Tensor]:
    """q -> q Lᵀ and k -> k Lᵀ, so that ‖L(q-k)‖² = ‖qLᵀ - kLᵀ‖². A per-head metric (H, D, D)
    needs k per query head, so grouped k heads are expanded first."""
    assert metric is not None
    metric = metric.to(q.dtype)
    if metric.dim() == 2:
        return q @ metric.T, k @ metric.T
    heads = q.shape[1]
    k = k.repeat_interleave(heads // k.shape[1], dim=1)
    lt = metric.transpose(-1, -2).unsqueeze(0)  # (1, H, D, D)
    return q @ lt, k @ lt


def _inv_sqrt_d(d: int) -> float:
    return 1.0 / math.sqrt(max(d, 1))


def _sqrt_d(d: int) -> float:
    return math.sqrt(d)


def _feature_map(features) -> Callable:
    """A user's ``features``: None, one map for q and k, or a (q map, k map) pair ->
    the (q, k, metric) -> (fq, fk) form every similarity has."""
    if features is None:
        return _identity
    if isinstance(features, (tuple, list)) and len(features) == 2 and all(map(callable, features)):
        fq_map, fk_map = features
    elif callable(features):
        fq_map = fk_map = features
    else:
        raise TypeError("features must be a callable x -> x' (for q and k) or a pair of them; "
                        f"got {type(features).__name__}")
    return lambda q, k, metric: (fq_map(q), fk_map(k))


def _scale_rule(scale) -> Callable[[int], float]:
    if scale is None:
        return _inv_sqrt_d
    if callable(scale):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"Similarity scale must be a finite number, a callable D -> scale or "
                        f"None (1/√D); got {scale!r}")
    return lambda d: float(scale)


class Similarity(Node):
    """One similarity: score = scale · Σ_d term(f(q)_d, f(k)_d).

    Args:
        term: ``term(q_d, k_d)``, elementwise on tensors whose last dim is d (q_d and k_d
            broadcast against each other); summed over d. Tensors it reads (a learnable
            weight of shape (D,), a temperature of shape ()) get gradients. None: q_d·k_d, the
            dot product, with its matrix-product kernels.
        features: a map applied to q and to k first (as cosine unit-normalizes), or a pair
            (map for q, map for k); None: the identity. Runs under ordinary autograd.
        scale: the default scale, a number or a callable D -> number; None: 1/√D.
            ``qkv.attention(scale=...)`` still overrides it.
        name: how it prints and the name it registers under by default.

    Every engine runs it, forward and backward: the reference, the fused CPU engine (its
    term compiled to C from the same function when it can be traced) and Triton.
    """

    def __init__(self, term: Callable | None = None, *, features=None, scale=None,
                 name: str | None = None):
        if term is not None and not callable(term):
            raise TypeError(f"term must be a callable term(q_d, k_d); got {type(term).__name__}")
        self.pairwise = DOT if term is None else Pairwise(
            name or getattr(term, "__name__", "term"), term)
        self.features = _feature_map(features)
        self.default_scale = _scale_rule(scale)
        self.name = name or (self.pairwise.name if term is not None else "user_dot")
        self.needs_metric = False

    @classmethod
    def builtin(cls, name: str, pairwise: Pairwise, features: Callable,
                default_scale: Callable[[int], float], needs_metric: bool = False) -> Similarity:
        sim = cls.__new__(cls)
        sim.name, sim.pairwise, sim.features = name, pairwise, features
        sim.default_scale, sim.needs_metric = default_scale, needs_metric
        return sim

    def tensors(self) -> tuple[Tensor, ...]:
        """Tensors of the pairwise term that gradients must reach (features' tensors get
        theirs through ordinary autograd)."""
        return self.pairwise.tensors()

    def raw_scores(self, q: Tensor, k: Tensor, metric: Tensor | None = None) -> Tensor:
        """The pairwise term of the features, unscaled, (B, H, Nq, Nk) for q (B, H, Nq, D) and
        k (B, H, Nk, D) (heads already matched); ``scores.modified_scores`` goes on from it."""
        fq, fk = self.features(q, k, metric)
        return self.pairwise.scores(fq, fk)

    def __repr__(self) -> str:
        return f"Similarity({self.name!r})"


BUILTIN = {
    s.name: s
    for s in (
        Similarity.builtin("dot", DOT, _identity, _inv_sqrt_d),
        # Unit vectors give scores in [-1, 1]; scale √D restores the spread that q·k/√D has for
        # unit-variance q and k, so a model can swap dot for cosine without retuning.
        Similarity.builtin("cosine", DOT, _unit, _sqrt_d),
        Similarity.builtin("l2", NEG_SQDIST, _identity, _inv_sqrt_d),
        Similarity.builtin("l1", NEG_L1, _identity, _inv_sqrt_d),
        Similarity.builtin("mahalanobis", NEG_SQDIST, _mahalanobis, _inv_sqrt_d,
                           needs_metric=True),
    )
}
SIMILARITIES: dict[str, Similarity] = dict(BUILTIN)


def register_similarity(name: str, similarity: Similarity) -> Similarity:
    """Make ``similarity`` available by ``name`` wherever a similarity name is accepted
    (``qkv.attention``, ``qkv.nn.MultiHeadAttention``, model configs). Built-in names cannot
    be replaced; a user name can (re-running a notebook cell)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"a similarity's name must be a non-empty str; got {name!r}")
    if not isinstance(similarity, Similarity):
        raise TypeError(f"register_similarity needs a qkv.Similarity; got "
                        f"{type(similarity).__name__}")
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in similarity and cannot be replaced")
    SIMILARITIES[name] = similarity
    return similarity


def get_similarity(name) -> Similarity:
    if isinstance(name, Similarity):
        return name
    if not isinstance(name, str) or name not in SIMILARITIES:
        raise ValueError(
            f"similarity must be one of {', '.join(repr(n) for n in SIMILARITIES)} (registered "
            f"names) or a qkv.Similarity; got {name!r}"
        )
    return SIMILARITIES[name]
