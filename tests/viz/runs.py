"""Small run directories laid out the way ``qkv train`` writes them (config.json, model.json,
tokenizers, weights), built without training, for the viz tests."""

from __future__ import annotations

import dataclasses
import json

import torch

from qkv.data.tokenizers import CharTokenizer, save_tokenizer
from qkv.models import GPT, GPTConfig, Transformer, TransformerConfig, ViT, ViTConfig
from qkv.train import checkpoint, config
from qkv.train.rundir import get_task
from qkv.train.tasks.common import build

TEXT = "the cat sat"


def start_run(run_dir, task, overrides=()):
    cfg = config.resolve(get_task(task).schema, task, get_task(task).presets["tiny"], None,
                         list(overrides))
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    return cfg


def build_run_model(run_dir, model_cls, config_cls, derived, configured):
    """The model, with its config in RUN/model.json as ``qkv train`` writes it."""
    model = build(model_cls, config_cls, derived, configured)
    (run_dir / "model.json").write_text(json.dumps(dataclasses.asdict(model.config)))
    return model


def make_lm_run(run_dir, overrides=()):
    cfg = start_run(run_dir, "lm", overrides)
    tok = CharTokenizer.train([TEXT + "Return"])
    save_tokenizer(tok, run_dir / "tokenizer.json")
    torch.manual_seed(0)
    model = build_run_model(run_dir, GPT, GPTConfig, {"vocab_size": tok.vocab_size}, cfg.model)
    checkpoint.save(run_dir, 1, model, {}, keep=1)
    return model, tok


def make_translate_run(run_dir):
    """A translate run of 2 + 2 tiny layers over character tokenizers, as model.safetensors."""
    cfg = start_run(run_dir, "translate", ["data.max_len=6"])
    src_tok, tgt_tok = CharTokenizer.train(["zweiundvierzig"]), CharTokenizer.train(["forty"])
    save_tokenizer(src_tok, run_dir / "tokenizer_src.json")
    save_tokenizer(tgt_tok, run_dir / "tokenizer_tgt.json")
    derived = {"src_vocab_size": src_tok.vocab_size, "tgt_vocab_size": tgt_tok.vocab_size,
               "pad_id": 0, "bos_id": 1, "eos_id": 2, "max_len": cfg.data.max_len + 2}
    torch.manual_seed(0)
    model = build_run_model(run_dir, Transformer, TransformerConfig, derived, cfg.model)
    # A bare model.safetensors (no checkpoints/) is a model too.
    from safetensors.torch import save_model

    save_model(model, str(run_dir / "model.safetensors"))
    return model, src_tok, tgt_tok


def make_vit_run(run_dir):
    """A vit run on 8x8 digits (a 2x2 patch grid), saved as a checkpoint."""
    cfg = start_run(run_dir, "vit")
    derived = {"image_size": 8, "in_channels": 1, "num_classes": 10}
    torch.manual_seed(0)
    model = build_run_model(run_dir, ViT, ViTConfig, derived, cfg.model)
    checkpoint.save(run_dir, 1, model, {}, keep=1)
    return model
