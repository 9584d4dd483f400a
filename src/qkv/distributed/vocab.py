"""A vocabulary-parallel token embedding and LM head: a (V, D) weight whose rows are split over
the ranks of a process group, and the lookup, logits and cross-entropy computed from those
rows alone (``train.fsdp`` uses them for a GPT's embedding and head, ``qkv.train.sharding``).

FSDP gathers a unit's whole weights for its forward and backward. A language model's
embedding is its largest tensor (SmolLM2: 49,152 x 576, 113 MB in float32), and the unit that
holds it keeps it gathered from the lookup at the start of the forward to the end of the
backward, beside its whole gradient (twice where the head is tied) and the reduce-scatter's
copy of it. Here no rank holds more than its rows, or a gradient larger than them:

- the lookup gathers the group's token ids, each rank reads the rows it holds (zeros for the
  others), and a reduce-scatter sums them into each rank's own (M, D);
- the head gathers the group's hidden states, and each rank computes the logits of its rows
  for every gathered position; the cross-entropy sums the log-sum-exp, the target's logit and
  (label smoothing) the logit sum over the group, position by position. The backward
  recomputes the logits chunk by chunk instead of keeping them;
- a rank's weight gradient comes from every position of the group, so it needs no
  reduce-scatter: it is summed over the replicas of its rows (context parallelism) only.

Gradients follow FSDP's convention: each rank scales its loss by the number of ranks, and
the gradient of a weight is averaged over them, so the sum is multiplied by 1/world.
All ranks of the group call these with tensors of the same shapes, as FSDP's gathers need.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function

# Logits computed at once by the cross-entropy, in elements (64 MB in float32): the
# (positions x rows) matrix is built in chunks of positions, never whole.
CHUNK_ELEMENTS = 1 << 24


@dataclass(frozen=True)
class VocabShards:
    """How a (vocab, D) weight is split: ``group``'s ranks hold consecutive blocks of
    ceil(vocab / size) rows (the last may be shorter), as ``Shard(0)`` places them;
    ``replicas``' ranks (or none) hold the same block. ``dtype``: the products' dtype (None:
    the weight's); autocast's takes precedence."""

    group: dist.ProcessGroup
    replicas: dist.ProcessGroup | None
    vocab: int
    dtype: torch.dtype | None = None

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def per_rank(self) -> int:
        return -(-self.vocab // self.size)

    def rows(self) -> tuple[int, int]:
        """[start, stop) of this rank's rows."""
        start = min(dist.get_rank(self.group) * self.per_rank, self.vocab)
        return start, min(start + self.per_rank, self.vocab)

    def grad_scale(self) -> float:
        replicas = 1 if self.replicas is None else dist.get_world_size(self.replicas)
        return 1.0 / (self.size * replicas)


def check_vocab(vocab: int, size: int) -> None:
    """Every rank needs at least one row."""
    per_rank = -(-vocab // size)
    if (size - 1) * per_rank >= vocab:
        raise ValueError(f"a vocabulary of {vocab} tokens cannot be split over {size} ranks "
                         f"by blocks of {per_rank} rows: the last rank gets none")


def _gather(x: Tensor, group) -> Tensor:
    """(M, ...) on each rank -> (size * M, ...), rank by rank."""
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _sum_scatter(x: Tensor, group) -> Tensor:
    """(size * M, ...) on each rank -> this rank's M rows, summed over the ranks."""
    out = x.new_empty((x.shape[0] // dist.get_world_size(group), *x.shape[1:]))
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def _weight_grad(grad: Tensor, shards: VocabShards, like: Tensor) -> Tensor:
    if shards.replicas is not None:
        dist.all_reduce(grad, group=shards.replicas)
    return grad.mul_(shards.grad_scale()).to(like.dtype)


def _local_index(ids: Tensor, shards: VocabShards) -> tuple[Tensor, Tensor]:
    """ids (M,) -> (row in this rank's block, or 0; whether the block holds it)."""
    start, stop = shards.rows()
    inside = (ids >= start) & (ids < stop)
    return torch.where(inside, ids - start, 0), inside


def _anywhere(flags: Tensor, shards: VocabShards) -> bool:
    """Whether any of the group's ``flags`` (already gathered), or a replica's, is set: every
    rank gets the same answer, so a refusal leaves no rank waiting in a collective."""
    found = flags.any().to(torch.int32).reshape(1)
    if shards.replicas is not None:
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=shards.replicas)
    return bool(found.item())


def _compute_dtype(x: Tensor, weight: Tensor, shards: VocabShards) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return shards.dtype or weight.dtype


def _chunks(n: int, width: int):
    step = max(1, CHUNK_ELEMENTS // max(width, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


class _Lookup(Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, shards: VocabShards) -> Tensor:
        index, inside = _local_index(_gather(ids.reshape(-1), shards.group), shards)
        # autocast leaves lookups in the weight's dtype; FSDP's param_dtype does not
        rows = F.embedding(index, weight.to(shards.dtype or weight.dtype))
        rows.masked_fill_(~inside.unsqueeze(1), 0)
        ctx.save_for_backward(index, inside, weight)
        ctx.shards = shards
        return _sum_scatter(rows, shards.group).view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        index, inside, weight = ctx.saved_tensors
        gathered = _gather(grad.reshape(-1, grad.shape[-1]).float(), ctx.shards.group)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        dw.index_add_(0, index[inside], gathered[inside])
        return None, _weight_grad(dw, ctx.shards, weight), None


def _row_stats(h: Tensor, w: Tensor, index: Tensor, inside: Tensor,
               shards: VocabShards) -> tuple[Tensor, Tensor, Tensor]:
    """h (n, D) over this rank's rows w (Vs, D) -> per position, summed over the group:
    log-sum-exp, target logit, logit sum (n,) each, in float32."""
    n = h.shape[0]
    top = torch.empty(n, device=h.device)
    stats = torch.empty(3, n, device=h.device)  # exp sum, target logit, logit sum
    for rows in _chunks(n, w.shape[0]):
        z = (h[rows] @ w.T).float()
        top[rows] = z.amax(1)
        stats[1, rows] = z.gather(1, index[rows, None]).squeeze(1) * inside[rows]
        stats[2, rows] = z.sum(1)
        stats[0, rows] = z.sub_(top[rows, None]).exp_().sum(1)
    best = top.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=shards.group)
    stats[0] *= (top - best).exp_()
    dist.all_reduce(stats, group=shards.group)
    return best + stats[0].log(), stats[1], stats[2]


class _CrossEntropySum(Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, shards: VocabShards,
                smoothing: float) -> Tensor:
        dtype = _compute_dtype(hidden, weight, shards)
        with torch.autocast(hidden.device.type, enabled=False):
            h = _gather(hidden.to(dtype), shards.group)
            every = _gather(targets, shards.group)
            if _anywhere((every < 0) | (every >= shards.vocab), shards):
                raise ValueError(f"targets: expected token ids in [0, {shards.vocab}) on every "
                                 "rank (no ignored positions)")
            index, inside = _local_index(every, shards)
            lse, target, total = _row_stats(h, weight.to(dtype), index, inside, shards)
            loss = lse - (1 - smoothing) * target - smoothing / shards.vocab * total
        ctx.save_for_backward(h, weight, index, inside, lse)
        ctx.shards, ctx.smoothing, ctx.dtype = shards, smoothing, dtype
        ctx.hidden_dtype = hidden.dtype
        m, rank = hidden.shape[0], dist.get_rank(shards.group)
        return loss[rank * m:(rank + 1) * m].sum()

    @staticmethod
    def backward(ctx, grad: Tensor):
        h, weight, index, inside, lse = ctx.saved_tensors
        shards, smoothing = ctx.shards, ctx.smoothing
        # each rank's positions carry the gradient of that rank's loss
        scale = _gather(grad.float().reshape(1), shards.group)
        scale = scale.repeat_interleave(h.shape[0] // shards.size)
        w = weight.to(ctx.dtype)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        dh = torch.empty_like(h)
        for rows in _chunks(h.shape[0], w.shape[0]):
            p = (h[rows] @ w.T).float().sub_(lse[rows, None]).exp_()
            if smoothing:
                p.sub_(smoothing / shards.vocab)
            at = torch.arange(rows.start, rows.stop, device=h.device)[inside[rows]]
            p[at - rows.start, index[at]] -= 1 - smoothing
            p = p.mul_(scale[rows, None]).to(ctx.dtype)
            dw += (p.T @ h[rows]).float()
            dh[rows] = p @ w
        dhidden = _sum_scatter(dh, shards.group).to(ctx.hidden_dtype)
        return dhidden, _weight_grad(dw, shards, weight), None, None, None


class _Logits(Function):
    """Chunks of positions, so that beside the (M, V) result only a chunk's logits of the
    group's positions exist (the result is what a caller asked for; three copies of it,
    computed, exchanged and reordered, are not)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, shards: VocabShards) -> Tensor:
        dtype = _compute_dtype(x, weight, shards)
        w = weight.to(dtype)
        hidden = x.reshape(-1, x.shape[-1])
        m, size, per = hidden.shape[0], shards.size, shards.per_rank
        result = x.new_empty((*x.shape[:-1], shards.vocab), dtype=dtype)
        out = result.view(m, shards.vocab)
        for rows in _chunks(m, size * per):
            h = _gather(hidden[rows].to(dtype), shards.group)
            z = h.new_zeros(h.shape[0], per)
            z[:, :w.shape[0]] = h @ w.T
            received = torch.empty_like(z)  # block s: rank s's columns of these positions
            dist.all_to_all_single(received, z, group=shards.group)
            n = rows.stop - rows.start
            columns = received.view(size, n, per).transpose(0, 1).reshape(n, -1)
            out[rows] = columns[:, :shards.vocab]
        ctx.save_for_backward(x, weight)
        ctx.shards, ctx.dtype = shards, dtype
        return result

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        shards, dtype = ctx.shards, ctx.dtype
        size, per, w = shards.size, shards.per_rank, weight.to(dtype)
        hidden, grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, shards.vocab)
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        dhidden = torch.empty_like(hidden)
        for rows in _chunks(hidden.shape[0], size * per):
            n = rows.stop - rows.start
            padded = grad.new_zeros((n, size * per), dtype=dtype)
            padded[:, :shards.vocab] = grad[rows]
            blocks = padded.view(n, size, per).transpose(0, 1).reshape(-1, per)
            dz = torch.empty_like(blocks)  # block s: rank s's positions, this rank's columns
            dist.all_to_all_single(dz, blocks, group=shards.group)
            dz = dz[:, :w.shape[0]]
            dw += (dz.T @ _gather(hidden[rows].to(dtype), shards.group)).float()
            dhidden[rows] = _sum_scatter(dz @ w, shards.group)
        return dhidden.view(x.shape), _weight_grad(dw, shards, weight), None


class ShardedEmbedding(nn.Module):
    """``nn.Embedding``'s lookup from this rank's rows: ``weight`` is a DTensor sharded on
    dim 0 as ``shards`` says (the parameter ``tok_emb.weight`` keeps its name and its whole
    shape for checkpoints)."""

    def __init__(self, weight: nn.Parameter, shards: VocabShards):
        super().__init__()
        self.weight, self.shards = weight, shards

    def forward(self, ids: Tensor) -> Tensor:
        """ids (B, N) -> (B, N, D)."""
        return _Lookup.apply(ids, self.weight.to_local(), self.shards)


class ShardedHead(nn.Module):
    """An LM head (``Linear(D, V, bias=False)``) from this rank's rows of its weight, which
    may be the embedding's (tied)."""

    def __init__(self, weight: nn.Parameter, shards: VocabShards):
        super().__init__()
        self.weight, self.shards = weight, shards

    def forward(self, x: Tensor) -> Tensor:
        """x (..., D) -> logits (..., V)."""
        return _Logits.apply(x, self.weight.to_local(), self.shards)

    def cross_entropy_sum(self, x: Tensor, targets: Tensor,
                          label_smoothing: float = 0.0) -> Tensor:
        """x (..., D), targets (...) -> ``F.cross_entropy(self(x), targets, reduction="sum",
        label_smoothing=...)`` in float32, without the (..., V) logits."""
        if not 0.0 <= label_smoothing <= 1.0 or math.isnan(label_smoothing):
            raise ValueError(f"label_smoothing: expected a number in [0, 1], got {label_smoothing}")
        return _CrossEntropySum.apply(x.reshape(-1, x.shape[-1]), self.weight.to_local(),
                                      targets.reshape(-1), self.shards, float(label_smoothing))
