"""``context_parallel_attention``: one long sequence split across the ranks of a group."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor

from qkv.core.masks import as_mask
from qkv.core.problem import build_problem
from qkv.core.weighting import Carry, as_weighting

from .agree import agree, describe
from .layout import pieces_per_rank
from .partials import refusal
from .ring import Plan, RingAttention
from .stick import StickRing

# What a block call may receive besides q, k, v, mask and score_mod.
_ENGINE_KWARGS = ("similarity", "scale", "metric", "backend", "weighting")


def context_parallel_attention(
    q: Tensor, k: Tensor, v: Tensor, *, group=None, layout: str = "contiguous",
    mask=None, score_mod=None, sinks: Tensor | None = None, sum_extra_grads: bool = True,
    **attention_kwargs,
) -> Tensor:
    """``qkv.attention`` of a sequence split across the P ranks of ``group``, ring style.

    Args:
        q: (B, H, Nq/P, D) this rank's shard of the queries.
        k: (B, Hkv, Nk/P, D) and v: (B, Hkv, Nk/P, Dv) this rank's shards of keys and values,
            in the same layout.
        group: a ``torch.distributed`` process group (None: the default group).
        layout: "contiguous" (rank r holds piece r of P) or "zigzag" (pieces r and 2P-1-r of
            2P, which balances causal work); ``qkv.distributed.shard`` cuts a whole sequence.
        mask, score_mod: as in ``qkv.attention``, meaning what they mean on the whole
            sequence: global positions, global segment ids, graph edges between global nodes,
            a bool tensor of the global (Nq, Nk) shape.
        sinks: (H,) a learned logit per head in each softmax denominator, or None (softmax
            only).
        sum_extra_grads: sum the gradients of the tensors the variant reads (ALiBi slopes, a
            metric, a tensor scale, a user similarity's tensors, a sigmoid bias, sinks) over the
            group, so each rank holds the whole sequence's gradient. Pass False when something
            else sums them already (DDP over the same ranks, as ``qkv train`` does).
        **attention_kwargs: similarity, scale, metric, backend and weighting, as in
            ``qkv.attention``. A weighting that reads the sequence length (sigmoid's default
            bias −log Nk, relu's 1/Nk) reads the whole sequence's Nk, not a shard's.

    Returns:
        (B, H, Nq/P, Dv), this rank's shard of the output, in the layout of q.

    Every rank must pass the same variant and shard shapes; otherwise, or when any rank's
    arguments are invalid, every rank raises the same ValueError (one small all_gather first).
    Dropout and attention weights are not offered: both would need the whole row.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs torch.distributed initialized "
                           "(torch.distributed.init_process_group)")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    error, problem, mask_obj, weighting = None, None, None, None
    try:
        unknown = set(attention_kwargs) - set(_ENGINE_KWARGS)
        if unknown:
            raise ValueError(f"unsupported arguments {sorted(unknown)}: context parallel "
                             f"attention takes {', '.join(_ENGINE_KWARGS)}, mask, score_mod "
                             "and sinks (dropout and weights need whole rows)")
        if q.shape[2] % pieces_per_rank(layout) or k.shape[2] % pieces_per_rank(layout):
            raise ValueError(f"the zigzag layout needs an even shard length; got q "
                             f"{q.shape[2]}, k {k.shape[2]} (2P must divide N)")
        kwargs = {key: attention_kwargs[key] for key in ("similarity", "scale", "metric")
                  if key in attention_kwargs}
        problem = build_problem(q, k, v, score_mod=score_mod, **kwargs)
        weighting = as_weighting(attention_kwargs.pop("weighting", "softmax"))
        weighting = weighting.for_context(k.shape[2] * world)
        weighting.check_heads(q.shape[1])
        if refusal(weighting):
            raise ValueError(refusal(weighting))
        mask_obj = as_mask(mask)
        if mask_obj is not None:
            mask_obj.check(q.shape[0], q.shape[1], q.shape[2] * world, k.shape[2] * world)
        if weighting.carry is Carry.STICK:
            weighting.check_mask(mask_obj, q.shape[0], q.shape[1], q.shape[2] * world,
                                 k.shape[2] * world, q.device)
        if sinks is not None and not weighting.is_softmax:
            raise ValueError(f"sinks add a logit to each softmax denominator; the weighting "
                             f"{weighting!r} has none")
        if sinks is not None and (not isinstance(sinks, Tensor) or sinks.shape != (q.shape[1],)):
            raise ValueError(f"sinks must be a tensor of shape (H,)=({q.shape[1]},)")
    except (ValueError, TypeError) as e:
        error = str(e)
    agree(group, _descriptor(q, k, v, layout, mask_obj, problem, sinks, weighting), error)
    extras = {id(t): t for t in problem.grad_tensors() + weighting.tensors()
              if t.is_floating_point()}
    plan = Plan(
        group=group, ranks=dist.get_process_group_ranks(group or dist.group.WORLD), rank=rank,
        layout=layout, nq_global=q.shape[2] * world, nk_global=k.shape[2] * world,
        mask=mask_obj, score_mod=problem.score_mod,
        engine_kwargs=dict(attention_kwargs, similarity=problem.similarity,
                           scale=problem.scale, metric=problem.metric),
        sum_extra_grads=sum_extra_grads, weighting=weighting,
    )
    ring = StickRing if weighting.carry is Carry.STICK else RingAttention
    return ring.apply(plan, q, k, v, sinks, *extras.values())


def _descriptor(q, k, v, layout, mask, problem, sinks, weighting) -> dict:
    """What every rank must agree on, as plain values."""
    desc = {
        "q": tuple(q.shape), "k": tuple(k.shape), "v": tuple(v.shape), "dtype": str(q.dtype),
        "layout": layout, "mask": describe(mask), "sinks": describe(sinks),
        "weighting": describe(weighting),
    }
    if problem is not None:
        tensors = (q, k, v, *problem.grad_tensors(),
                   *(weighting.tensors() if weighting is not None else ()))
        desc.update(
            score_mod=describe(problem.score_mod), similarity=describe(problem.similarity),
            scale=describe(problem.scale), metric=describe(problem.metric),
            requires_grad=[t.requires_grad for t in tensors],
        )
    return desc
