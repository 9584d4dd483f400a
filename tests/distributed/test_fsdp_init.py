"""``train.fsdp`` with ``--init``: each rank builds the model on the meta device, shards it,
and fills its shard from the checkpoint one tensor at a time; the weights, the tie and the
RoPE table are the one-process load's, and so are the losses. The whole model gathered to
rank 0 at the end is the shards', tied."""

import json
import os
import string

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from qkv.cli import main
from qkv.models import GPT
from qkv.models.pretrained.llama import LAYER_TENSORS, MODEL_TENSORS, _gpt_config
from qkv.train import plan, run
from qkv.train.loop import Trainer
from qkv.train.tasks import TASKS

from ..train.conftest import losses, private_cache  # noqa: F401  (a fixture)
from .launch import run_ranks, values
from .test_fsdp import assert_same_losses

ALPHABET = string.ascii_lowercase + " .,\n"
VOCAB = ["<unk>", "<s>", "</s>", *ALPHABET]


def write_llama_dir(path) -> None:
    """A random 2-layer LLaMA directory (grouped heads, RoPE at theta 500, tied head; every
    weight drawn, norms too) with a character tokenizer: config.json, model.safetensors."""
    from tokenizers import Tokenizer, models

    torch.manual_seed(0)
    config = _gpt_config(vocab_size=len(VOCAB), block_size=128, n_layer=2, n_head=4,
                         d_model=32, n_kv_head=2, d_ff=64, norm_eps=1e-5, rope_base=500.0,
                         tie_embeddings=True)
    params = dict(GPT(config).named_parameters())
    tensors = {hf: params[ours] for ours, (hf, _) in MODEL_TENSORS.items() if ours in params}
    for i in range(config.n_layer):
        tensors.update({f"model.layers.{i}.{hf}": params[f"blocks.{i}.{ours}"]
                        for ours, (hf, _) in LAYER_TENSORS.items()})
    path.mkdir()
    save_file({name: (t + 0.05 * torch.randn_like(t)).detach().contiguous()
               for name, t in tensors.items()}, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": len(VOCAB), "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5,
        "rope_theta": 500.0, "tie_word_embeddings": True}))
    vocab = {c: i for i, c in enumerate(VOCAB)}
    Tokenizer(models.BPE(vocab, [], unk_token="<unk>")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def settings(init, text) -> list[str]:
    return [f"train.init={json.dumps(str(init))}", f"data.path={text}", "model.block_size=32",
            "train.steps=4", "train.batch_size=2", "train.threads=1", "eval.max_tokens=64",
            "eval.max_new_tokens=4"]


def sharded_fine_tune(rank: int, world: int, init, text, run_dir) -> dict:
    """A two-rank FSDP fine-tune from ``init``, its model inspected before the first step:
    the devices the task built parameters on, and how each filled parameter compares with
    the one-process load of the checkpoint."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    task = TASKS["lm"]
    built, build = set(), task.build_model

    def recorded(cfg, data):
        model = build(cfg, data)
        built.update(p.device.type for p in model.parameters())
        return model

    task.build_model = recorded
    overrides = (*settings(init, text), "train.fsdp=true", "train.checkpointing=true")
    cfg = run.configure(run.RunRequest("lm", overrides=overrides))
    trainer = Trainer(plan.make(task, cfg, run_dir, resume=False), quiet=True)
    model, whole = trainer.model, GPT.from_pretrained(init)
    params = dict(model.named_parameters())
    report = {
        "built on": built,
        "sharded": all(isinstance(p, DTensor) and p.to_local().numel() < p.numel()
                       for p in params.values()),
        "equal": all(torch.equal(params[name].full_tensor(), p)
                     for name, p in whole.named_parameters()),
        "tied": model.lm_head.weight is model.tok_emb.weight,
        "buffers": all(torch.equal(b, whole.get_buffer(name))
                       for name, b in model.named_buffers()),
    }
    # The whole trained model gathered to rank 0 (for the sample): the shards' values, tied.
    copy = trainer.run().model
    gathered = {name: p.full_tensor() for name, p in model.named_parameters()}
    if rank == 0:
        report["whole"] = (copy.lm_head.weight is copy.tok_emb.weight and all(
            torch.equal(p, gathered[name]) for name, p in copy.named_parameters()) and all(
            torch.equal(b, whole.get_buffer(name)) for name, b in copy.named_buffers()))
    return report


def test_a_sharded_fine_tune_fills_each_rank_s_shard_and_follows_one_process(tmp_path):
    write_llama_dir(tmp_path / "llama")
    text = tmp_path / "notes.txt"
    text.write_text("attention is a weighted average of values.\n" * 60)
    argv = [f"--set={s}" for s in settings(tmp_path / "llama", text)]
    assert main(["train", "lm", "--run-dir", str(tmp_path / "one"), "--quiet", *argv]) == 0
    reports = values(run_ranks(sharded_fine_tune, 2, tmp_path / "llama", text,
                               tmp_path / "two", timeout=240))
    assert reports[0].pop("whole") is True
    for report in reports:
        assert report == {"built on": {"meta"}, "sharded": True, "equal": True, "tied": True,
                          "buffers": True}
    assert_same_losses(losses(tmp_path / "one"), losses(tmp_path / "two"))
