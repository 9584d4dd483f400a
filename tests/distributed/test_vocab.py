"""The vocabulary-parallel embedding and head against float64 ``F.embedding``, ``F.linear``
and ``F.cross_entropy`` on the whole weight: values, and gradients under FSDP's convention
(the weight's gradient averaged over every rank, replicas included)."""

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from qkv.distributed.vocab import ShardedEmbedding, ShardedHead, VocabShards, check_vocab

from .launch import run_ranks, values

VOCAB, D, M = 11, 8, 6


def inputs(rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randint(0, VOCAB, (2, M // 2), generator=g),
            torch.randn(2, M // 2, D, generator=g, dtype=torch.float64),
            torch.randint(0, VOCAB, (2, M // 2), generator=g),
            torch.randn((), generator=g, dtype=torch.float64),   # this rank's loss scale
            torch.randn(2, M // 2, VOCAB, generator=g, dtype=torch.float64))  # logits' grad


def _rank(rank: int, world: int, context: int, smoothing: float,
          dtype: torch.dtype | None = None) -> str:
    weight = torch.randn(VOCAB, D, generator=torch.Generator().manual_seed(0),
                         dtype=torch.float64)
    grid = torch.arange(world).reshape(-1, context).T
    mesh = DeviceMesh("cpu", grid, mesh_dim_names=("context", "data"))
    shards = VocabShards(mesh.get_group("data"), mesh.get_group("context") if context > 1
                         else None, VOCAB, dtype)
    param = torch.nn.Parameter(distribute_tensor(weight.float(), mesh, [Replicate(), Shard(0)],
                                                 src_data_rank=None))
    embedding, head = ShardedEmbedding(param, shards), ShardedHead(param, shards)
    ids, hidden, targets, scale, dlogits = inputs(rank)
    h = hidden.float().requires_grad_()

    # bfloat16 products (FSDP's param_dtype): bfloat16's rounding, with float32 sums
    tol = {} if dtype is None else {"rtol": 2e-2, "atol": 5e-2}
    looked = embedding(ids)
    torch.testing.assert_close(looked, F.embedding(ids, weight.to(looked.dtype)), rtol=0, atol=0)
    loss = head.cross_entropy_sum(h, targets, label_smoothing=smoothing)
    logits = head(h)
    expected_logits = F.linear(hidden, weight)
    torch.testing.assert_close(logits.double(), expected_logits, **(tol or {"rtol": 1e-5,
                                                                          "atol": 1e-5}))
    expected = F.cross_entropy(expected_logits.flatten(0, 1), targets.flatten(),
                               label_smoothing=smoothing, reduction="sum")
    torch.testing.assert_close(loss.double(), expected, **(tol or {"rtol": 1e-6, "atol": 1e-6}))
    ((loss * scale.float()) + (logits.float() * dlogits.float()).sum()
     + (looked.float() * hidden.float()).sum()).backward()

    # the same on every rank's inputs, in float64: each rank's hidden gradient is its own,
    # the weight's is the mean over all ranks
    w = weight.clone().requires_grad_()
    mine = None
    for r in range(world):
        ids_r, hidden_r, targets_r, scale_r, dlogits_r = inputs(r)
        h_r = hidden_r.clone().requires_grad_()
        z = F.linear(h_r, w)
        total = (F.cross_entropy(z.flatten(0, 1), targets_r.flatten(), label_smoothing=smoothing,
                                 reduction="sum") * scale_r
                 + (z * dlogits_r).sum() + (F.embedding(ids_r, w) * hidden_r).sum())
        (total / world).backward()
        if r == rank:
            mine = h_r.grad * world
    tol = tol or {"rtol": 1e-5, "atol": 1e-5}
    bad = targets.clone()
    bad[0, 0] = VOCAB if rank == world - 1 else 0
    try:  # one rank's bad target: every rank refuses the call
        head.cross_entropy_sum(h, bad)
    except ValueError as e:
        assert f"targets: expected token ids in [0, {VOCAB})" in str(e)
    else:
        raise AssertionError("a target outside the vocabulary was accepted")
    assert h.grad.dtype == torch.float32 and param.grad.dtype == torch.float32
    torch.testing.assert_close(h.grad.double(), mine, **tol)
    torch.testing.assert_close(param.grad.full_tensor().double(), w.grad, **tol)
    return "ok"


@pytest.mark.parametrize(("world", "context"), [(3, 1), (4, 2)])
def test_the_split_vocabulary_computes_what_the_whole_weight_does(world, context):
    # 11 rows over 3 ranks: blocks of 4, 4 and 3; over the (2 x 2) mesh: 6 and 5, replicated
    assert values(run_ranks(_rank, world, context, 0.1 if context == 1 else 0.0)) == ["ok"] * world


def test_bfloat16_products_keep_float32_weights_and_gradients():
    assert values(run_ranks(_rank, 2, 1, 0.0, torch.bfloat16)) == ["ok"] * 2


def sharded_decoding(rank: int, world: int) -> bool:
    """Whether a GPT sharded by train.fsdp (its embedding and head split by vocabulary rows)
    decodes, with its KV cache, what the whole model decodes."""
    from qkv.models import GPT, GPTConfig
    from qkv.train.config import TrainConfig
    from qkv.train.distributed import Env
    from qkv.train.sharding import shard

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, block={
        "d_model": D, "n_head": 2, "d_ff": 16, "dropout": 0.0})).eval()
    prompt = torch.randint(0, VOCAB, (2, 3))
    whole = model.generate(prompt, max_new_tokens=5, temperature=0)
    logits = model(prompt)
    shard(model, Env(rank, world, torch.device("cpu")), TrainConfig(fsdp=True))
    assert isinstance(model.lm_head, ShardedHead) and model.lm_head.weight is model.tok_emb.weight
    torch.testing.assert_close(model(prompt), logits)
    return torch.equal(model.generate(prompt, max_new_tokens=5, temperature=0), whole)


def test_a_sharded_gpt_decodes_as_the_whole_one():
    assert values(run_ranks(sharded_decoding, 3, timeout=120)) == [True] * 3


def test_a_vocabulary_too_small_for_the_ranks_is_refused():
    check_vocab(11, 3)
    with pytest.raises(ValueError, match="vocabulary of 5 tokens cannot be split over 4 ranks"):
        check_vocab(5, 4)
