"""FSDP (``train.fsdp``): parameters, gradients and optimizer state sharded over the ranks.

Every ``TransformerBlock`` is one FSDP unit (compiled first with ``train.compile``, as
torchtitan does: each block is one graph and FSDP's gathers stay outside it); the root unit
holds the rest (positions, final norm). A unit's weights are all-gathered just before its forward
and backward and freed after; its gradients are reduce-scattered, so each rank keeps 1/D of
them and its optimizer updates that 1/D.

A GPT's token embedding and LM head (tied or not) are split by vocabulary rows over the same
ranks instead (``qkv.distributed.vocab``): gathered, the embedding would be the largest
weight of the step, held whole from the lookup to the end of the backward with its gradient
and the reduce-scatter's copy (docs/distributed.md, "Memory"). Their parameters are DTensors
placed as FSDP's are, so checkpoints, the optimizer and gradient clipping see one layout.

With ``train.context_parallel`` = C the ranks of a context group read different tokens of
the same sequences and need the same weights: the mesh is (context, data), FSDP shards over
"data" and replicates over "context" (HSDP), so each context group holds the same shard and
its gradients are summed over the group as well.

A model whose weights come from a checkpoint (``train.init``, or a sharded checkpoint resumed)
is built with its parameters on the meta device, sharded, then materialized
(``qkv.models.pretrained.materialize``): each rank allocates its shard alone, and the
checkpoint fills it one tensor at a time, so no rank ever holds the whole model.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..distributed.vocab import ShardedEmbedding, ShardedHead, VocabShards, check_vocab
from ..models import GPT
from ..nn.blocks import TransformerBlock
from .distributed import Env

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _fsdp():
    """FSDP's and DTensor's modules, imported when a model is sharded: they take 1.5 s, which
    every command would pay at start-up (docs/performance.md, "Start-up")."""
    import torch.distributed.fsdp as fsdp
    import torch.distributed.tensor as dtensor

    return fsdp, dtensor


def check(t, env: Env, resume: bool = False) -> None:
    """One line for settings FSDP cannot use; every rank reaches the same verdict. In one
    process it names both ways on: torchrun, or the overrides that run without sharding (a
    sharded checkpoint resumes there too: DCP reshards it)."""
    if not t.fsdp:
        for key in ("param_dtype", "reduce_dtype"):
            if getattr(t, key) != "float32":
                raise ValueError(f"train.{key} applies with train.fsdp=true only")
        return
    if not env.distributed:
        overrides = " ".join(["--set train.fsdp=false"] + [
            f"--set train.{key}=float32" for key in ("param_dtype", "reduce_dtype")
            if getattr(t, key) != "float32"])
        alone = "resume it" if resume else "train"
        raise ValueError("train.fsdp shards the model over torchrun's processes; this run has "
                         "one (WORLD_SIZE=1): start it with torchrun --nproc_per_node=N, N >= 2, "
                         f"or {alone} in one process with {overrides}")


def fsdp_mesh(env: Env, context_parallel: int) -> DeviceMesh:
    """The ranks FSDP shards over ("data") and, with context parallelism, replicates over
    ("context"): the rank grid of ``distributed.mesh``, whose rows are context groups."""
    if context_parallel == 1:
        return init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("data",))
    grid = torch.arange(env.world_size).reshape(-1, context_parallel).T
    return DeviceMesh(env.device.type, grid, mesh_dim_names=("context", "data"))


def shard(model: torch.nn.Module, env: Env, t) -> torch.nn.Module:
    """Shard ``model`` in place (its parameters become DTensors) and return it."""
    fsdp, _ = _fsdp()
    mesh = fsdp_mesh(env, t.context_parallel)
    policy = fsdp.MixedPrecisionPolicy(param_dtype=DTYPES[t.param_dtype],
                                  reduce_dtype=DTYPES[t.reduce_dtype])
    for block in [m for m in model.modules() if isinstance(m, TransformerBlock)]:
        if t.compile:
            block.compile()  # in place: the state dict keeps its names
        fsdp.fully_shard(block, mesh=mesh, mp_policy=policy)
    vocab = shard_vocabulary(model, mesh, DTYPES[t.param_dtype])
    fsdp.fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=vocab)
    if hasattr(model, "generate"):  # evaluation decodes through it, not through forward:
        # its call gathers the root unit's weights (the translate model's encode and
        # decode read its embeddings directly)
        fsdp.register_fsdp_forward_method(model, "generate")
    return model


def shard_vocabulary(model: torch.nn.Module, mesh: DeviceMesh,
                     dtype: torch.dtype) -> set[torch.nn.Parameter]:
    """Replace a GPT's ``tok_emb`` and ``lm_head`` by their vocabulary-parallel forms over
    ``mesh``'s "data" ranks (replicated over "context"); return their parameters, which FSDP
    then leaves alone. Other models keep their embeddings in the root unit."""
    if not isinstance(model, GPT):
        return set()
    data = mesh.get_group("data")
    vocab = model.config.vocab_size
    check_vocab(vocab, mesh["data"].size())
    shards = VocabShards(data, mesh.get_group("context") if mesh.ndim == 2 else None, vocab,
                         dtype)
    _, dtensor = _fsdp()
    placements = [dtensor.Replicate()] * (mesh.ndim - 1) + [dtensor.Shard(0)]

    def rows(weight: torch.Tensor) -> torch.nn.Parameter:
        # each rank cuts its rows locally, as fully_shard does: every rank built the same model
        return torch.nn.Parameter(dtensor.distribute_tensor(weight.detach(), mesh, placements,
                                                            src_data_rank=None))

    tied = model.lm_head.weight is model.tok_emb.weight
    embedding = rows(model.tok_emb.weight)
    head = embedding if tied else rows(model.lm_head.weight)
    model.tok_emb = ShardedEmbedding(embedding, shards)
    model.lm_head = ShardedHead(head, shards)
    return {embedding, head}
