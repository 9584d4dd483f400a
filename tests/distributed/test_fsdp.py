"""``train.fsdp``: two gloo ranks under torchrun follow one process, and their sharded
checkpoints resume in one process and load for inference there."""

import functools
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from qkv.cli import main
from qkv.nn.blocks import TransformerBlock
from qkv.train import checkpoint, plan, run
from qkv.train.config import resolve
from qkv.train.loop import Trainer
from qkv.train.rundir import load_run
from qkv.train.tasks import TASKS

from ..train.conftest import losses, private_cache, tiny_lm  # noqa: F401  (a fixture)
from .launch import run_ranks, values


def torchrun(ranks: int, argv: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={ranks}", "-m", "qkv.cli", *argv],
        env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def assert_same_losses(a, b, rel: float = 1e-5) -> None:
    assert [s for s, _, _ in a] == [s for s, _, _ in b]
    for (_, x, _), (_, y, _) in zip(a, b, strict=True):
        assert y == pytest.approx(x, rel=rel)


def held_out(run_dir) -> float:
    """The final evaluation's held-out loss, from RUN/metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["eval"]["loss"] for r in records if "eval" in r][-1]


@pytest.mark.slow
def test_fsdp_follows_one_process_and_resumes_in_one(tmp_path, capsys):
    args = ["--set", "train.checkpoint_every=4", "--set", "train.keep_checkpoints=3",
            "--set", "train.accumulate=2"]
    assert main(tiny_lm(tmp_path / "one", 8, *args)) == 0
    # With activation checkpointing inside the sharded blocks: the same numbers.
    torchrun(2, tiny_lm(tmp_path / "two", 8, *args, "--set", "train.fsdp=true",
                        "--set", "train.checkpointing=true"))
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "two"))
    # The held-out loss, which the sharded ranks score without whole logits.
    assert held_out(tmp_path / "two") == pytest.approx(held_out(tmp_path / "one"), rel=1e-5)
    newest = checkpoint.list_checkpoints(tmp_path / "two")[0]
    assert sorted(p.name for p in (newest / "state").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]

    # Resumed at one rank from step 4 (as after a crash): the same steps 5 to 8. Without the
    # override the refusal names it.
    shutil.copytree(tmp_path / "two", tmp_path / "resumed")
    shutil.rmtree(checkpoint.list_checkpoints(tmp_path / "resumed")[0])
    capsys.readouterr()
    assert main(tiny_lm(tmp_path / "resumed", 8, *args, "--resume")) == 2
    assert "resume it in one process with --set train.fsdp=false\n" in capsys.readouterr().err
    assert main(tiny_lm(tmp_path / "resumed", 8, *args, "--resume",
                        "--set", "train.fsdp=false")) == 0
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "resumed"))

    # One process reads the sharded run: the weights of the one-process run.
    plain = run.load(tmp_path / "one")[3].state_dict()
    for loaded in (run.load(tmp_path / "two")[3], load_run(tmp_path / "two").model):
        for name, tensor in loaded.state_dict().items():
            torch.testing.assert_close(tensor, plain[name], rtol=1e-4, atol=1e-5)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "two"), "--prompt", "Return"]) == 0
    assert capsys.readouterr().out.startswith("Return")
    assert main(["export", str(tmp_path / "two"), "-o", str(tmp_path / "model.safetensors")]) == 0
    exported = load_file(tmp_path / "model.safetensors")
    assert exported.keys() <= plain.keys() and "lm_head.weight" in plain
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, plain[name], rtol=1e-4, atol=1e-5)

    # A shard that no longer matches the manifest: the previous checkpoint is used.
    shard = newest / "state" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    found = checkpoint.load_latest(tmp_path / "two")
    assert found.step == 4 and "__1_0.distcp does not match" in capsys.readouterr().err


@pytest.mark.slow
def test_bfloat16_weights_with_float32_reduction_follow_float32(tmp_path):
    """train.param_dtype=bfloat16: the blocks, the vocabulary-split embedding and head compute
    in bfloat16 from float32 shards; the losses stay within bfloat16's rounding of float32's."""
    assert main(tiny_lm(tmp_path / "one", 4)) == 0
    torchrun(2, tiny_lm(tmp_path / "two", 4, "--set", "train.fsdp=true",
                        "--set", "train.param_dtype=bfloat16"))
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "two"), rel=3e-4)
    assert losses(tmp_path / "two") != losses(tmp_path / "one")  # bfloat16 did compute
    assert held_out(tmp_path / "two") == pytest.approx(held_out(tmp_path / "one"), rel=3e-4)


def test_fsdp_needs_torchrun(tmp_path, capsys):
    assert main(tiny_lm(tmp_path / "run", 2, "--set", "train.fsdp=true")) == 2
    err = capsys.readouterr().err
    assert err.startswith("qkv: error: train.fsdp ") and "WORLD_SIZE=1" in err
    assert "torchrun --nproc_per_node=N" in err
    assert err.endswith("or train in one process with --set train.fsdp=false\n")
    assert main(tiny_lm(tmp_path / "run", 2, "--set", "train.param_dtype=bfloat16")) == 2
    assert "train.param_dtype applies with train.fsdp=true only" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_sharded_resume_in_one_process_names_the_overrides_that_run_it(tmp_path, capsys):
    """Every override the one-process resume needs: train.fsdp and the FSDP-only dtypes."""
    assert main(tiny_lm(tmp_path / "run", 3)) == 0
    capsys.readouterr()
    assert main(tiny_lm(tmp_path / "run", 6, "--resume", "--set", "train.fsdp=true",
                        "--set", "train.param_dtype=bfloat16")) == 2
    assert capsys.readouterr().err.endswith(
        "or resume it in one process with --set train.fsdp=false "
        "--set train.param_dtype=float32\n")


@pytest.mark.slow
def test_a_run_continued_with_fsdp_and_context_parallelism_follows_one_process(tmp_path):
    """A one-process run resumed from its step-2 checkpoint at four ranks, FSDP over the two
    data rows with each context pair holding the same shard, gives the same steps 3 to 6; the
    four ranks' sharded step-4 checkpoint, resumed at two ranks, the same steps 5 and 6."""
    args = ["--set", "train.checkpoint_every=2", "--set", "train.keep_checkpoints=3"]
    assert main(tiny_lm(tmp_path / "one", 6, *args)) == 0
    shutil.copytree(tmp_path / "one", tmp_path / "four")
    for newer in checkpoint.list_checkpoints(tmp_path / "four")[:2]:  # steps 6 and 4
        shutil.rmtree(newer)
    torchrun(4, tiny_lm(tmp_path / "four", 6, *args, "--resume", "--set", "train.fsdp=true",
                        "--set", "train.context_parallel=2"))
    assert checkpoint.list_checkpoints(tmp_path / "four")[0].joinpath("state").is_dir()
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "four"))
    shutil.copytree(tmp_path / "four", tmp_path / "two")
    shutil.rmtree(checkpoint.list_checkpoints(tmp_path / "two")[0])  # back to step 4
    step4 = checkpoint.list_checkpoints(tmp_path / "two")[0]
    assert len(list((step4 / "state").glob("*.distcp"))) == 4  # written by the four ranks
    torchrun(2, tiny_lm(tmp_path / "two", 6, *args, "--resume", "--set", "train.fsdp=true"))
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "two"))


def compiled_run(rank: int, world: int, run_dir) -> int:
    """A compiled FSDP run on this gloo rank, every compile on the aot_eager backend
    (inductor needs a C++ compiler and minutes); returns (blocks, compiled blocks)."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    torch.compile = functools.partial(torch.compile, backend="aot_eager")
    cfg = resolve(TASKS["lm"].schema, "lm", TASKS["lm"].presets["tiny"], None, [
        "train.steps=4", "train.threads=1", "train.fsdp=true", "train.compile=true"])
    trainer = Trainer(plan.make(TASKS["lm"], cfg, run_dir, resume=False), quiet=True)
    trainer.run()
    blocks = [m for m in trainer.model.modules() if isinstance(m, TransformerBlock)]
    return len(blocks), sum(block._compiled_call_impl is not None for block in blocks)


@pytest.mark.slow
def test_fsdp_compiles_each_block_and_follows_one_process(tmp_path):
    assert main(tiny_lm(tmp_path / "one", 4)) == 0
    for blocks, compiled in values(run_ranks(compiled_run, 2, tmp_path / "two", timeout=240)):
        assert blocks == compiled > 0
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "two"))


def sharded_beam_search(rank: int, world: int) -> bool:
    """Whether a sharded translation model's beam search (which reads the embeddings outside
    forward) writes what the unsharded model writes."""
    from qkv.models import Transformer, TransformerConfig
    from qkv.train.config import TrainConfig
    from qkv.train.distributed import Env
    from qkv.train.sharding import shard

    torch.manual_seed(0)
    model = Transformer(TransformerConfig(
        src_vocab_size=13, tgt_vocab_size=11, n_encoder_layers=1, n_decoder_layers=1,
        block={"d_model": 16, "n_head": 2, "d_ff": 32, "dropout": 0.0})).eval()
    src = torch.randint(4, 13, (2, 5))
    whole = model.generate(src, max_new_tokens=6, beam_size=2)
    shard(model, Env(rank, world, torch.device("cpu")), TrainConfig(fsdp=True))
    return torch.equal(model.generate(src, max_new_tokens=6, beam_size=2), whole)


def test_a_sharded_translation_model_decodes_as_the_whole_one():
    assert values(run_ranks(sharded_beam_search, 2, timeout=120)) == [True, True]


def test_the_memory_check_counts_a_rank_s_shard(monkeypatch):
    """10G parameters with 100 GB: 160 GB unsharded, 40 + 160/2 GB at two shards, and
    40 + 160/4 = 80 GB at four, which fits; a model a checkpoint fills is never whole on a
    rank: 160/2 = 80 GB at two shards fits."""
    from qkv.train.config import ConfigError

    monkeypatch.setattr(plan, "available_memory", lambda device: 100e9)
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match=r"about 160.0 GB to train \(float32 weights"):
        plan.check_fits(10**10, cpu)
    with pytest.raises(ConfigError, match=r"about 120.0 GB to train \(the whole float32 "
                                          r"weights, then 1/2 of them"):
        plan.check_fits(10**10, cpu, shards=2)
    plan.check_fits(10**10, cpu, shards=4)
    plan.check_fits(10**10, cpu, shards=2, whole=False)
    monkeypatch.setattr(plan, "available_memory", lambda device: 50e9)
    with pytest.raises(ConfigError, match=r"about 80.0 GB to train \(1/2 of the float32 "
                                          r"weights, of their gradients"):
        plan.check_fits(10**10, cpu, shards=2, whole=False)


def test_a_context_parallel_degree_that_does_not_divide_the_ranks_is_refused_first(tmp_path):
    """Checked before the data, the memory check and any collective: every rank of the two
    says so and stops."""
    from qkv.train.distributed import Env

    cfg = resolve(TASKS["lm"].schema, "lm", TASKS["lm"].presets["tiny"], None,
                  ["train.fsdp=true", "train.context_parallel=3"])
    with pytest.raises(ValueError, match=r"^train.context_parallel=3 must divide the number "
                                         r"of processes \(2\)$"):
        plan.make(TASKS["lm"], cfg, tmp_path / "run", False, Env(1, 2, torch.device("cpu")))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_launchers_meet_as_two_nodes_and_follow_one_process(tmp_path):
    """docs/distributed.md's two-machine command line, as two torchrun launchers of one rank
    each on this machine, meeting through a c10d rendezvous on 127.0.0.1."""
    assert main(tiny_lm(tmp_path / "one", 4)) == 0
    endpoint = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", endpoint,
               "--rdzv_id", "two-nodes", "-m", "qkv.cli",
               *tiny_lm(tmp_path / "two", 4, "--set", "train.fsdp=true")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    try:
        outputs = [node.communicate(timeout=300) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-3000:]
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "two"))
    # The held-out loss, which the sharded ranks score without whole logits.
    assert held_out(tmp_path / "two") == pytest.approx(held_out(tmp_path / "one"), rel=1e-5)
    newest = checkpoint.list_checkpoints(tmp_path / "two")[0]
    assert sorted(p.name for p in (newest / "state").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]
