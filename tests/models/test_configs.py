"""The model configs compose a BlockConfig and a PositionsConfig: the sections' fields are
declared once, with their limits beside them; dicts fill in over each model's defaults; a
flat config and other parameter names are refused."""

import dataclasses

import pytest
import torch

from qkv.models import GPT, EncoderConfig, GPTConfig, Transformer, TransformerConfig, ViTConfig
from qkv.nn import BlockConfig, PositionsConfig

MODEL_CONFIGS = (GPTConfig, EncoderConfig, TransformerConfig, ViTConfig)
SECTION_FIELDS = {f.name for cls in (BlockConfig, PositionsConfig)
                  for f in dataclasses.fields(cls)}


@pytest.mark.parametrize("cls", MODEL_CONFIGS)
def test_no_model_config_restates_a_section_field(cls):
    names = {f.name for f in dataclasses.fields(cls)}
    assert {"block", "positions"} <= names
    assert names & SECTION_FIELDS == set()


def test_model_configs_share_only_model_level_fields():
    fields = [{f.name for f in dataclasses.fields(cls)} for cls in MODEL_CONFIGS]
    shared = set().union(*(a & b for i, a in enumerate(fields) for b in fields[i + 1:]))
    assert shared == {"block", "positions", "vocab_size", "n_layer", "max_len", "num_classes",
                      "pooling", "window", "pad_id"}


def test_a_dict_section_fills_in_over_the_models_defaults():
    paper = TransformerConfig(10, 10, block={"d_model": 64, "n_head": 4})
    assert (paper.block.ffn, paper.block.norm_first, paper.block.d_ff) == ("relu", False, 2048)
    assert paper.positions.kind == "sinusoidal"
    assert ViTConfig(8, 4, 1, 2, 1, block={"d_model": 16, "n_head": 2}).block.norm_eps == 1e-6
    assert EncoderConfig(10, 0, 8, 1).block.dropout == 0.1
    gpt = GPTConfig(10, 8, 1, block=BlockConfig(d_model=16, n_head=2))
    assert gpt.block.norm_first and gpt.positions == PositionsConfig(kind="learned")


@pytest.mark.parametrize("make, message", [
    (lambda: GPTConfig(10, 8, 1, block={"n_heads": 2}), "block has no key 'n_heads'"),
    (lambda: GPTConfig(10, 8, 1, block="big"), "block must be a BlockConfig"),
    (lambda: GPTConfig(10, 8, 1, positions={"kind": "spiral"}), "kind: expected one of"),
    (lambda: BlockConfig(d_model=30, n_head=4), "d_model=30 must be divisible by n_head=4"),
    (lambda: BlockConfig(dropout=1.0), r"dropout: expected a value in \[0, 1\)"),
    (lambda: BlockConfig(similarity="l3"), "similarity: expected one of"),
    (lambda: GPTConfig(10, 0, 1), r"block_size: expected a value in \[1, inf\)"),
    (lambda: EncoderConfig(10, 0, 8, 1, pooling="max"), "pooling: expected one of"),
])
def test_bad_values_name_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


FLAT = dict(vocab_size=37, block_size=20, n_layer=2, n_head=4, d_model=16, n_kv_head=2,
            positions="rope", rope_base=500.0, norm="rmsnorm", ffn="swiglu", bias=False,
            dropout=0.0, similarity="dot", attention="multihead", tie_embeddings=False)


def test_the_flat_form_is_refused_naming_its_first_key():
    with pytest.raises(TypeError, match="n_head"):
        GPTConfig(**FLAT)


@pytest.mark.parametrize(("new", "old"), [("ffn.up_proj.", "ffn.linear1."),
                                          ("positions.table.", "positions.learned.table.")])
def test_weights_under_other_names_are_refused_naming_them(new, old):
    config = GPTConfig(11, 8, 1, block={"d_model": 16, "n_head": 2, "ffn": "gelu"})
    state = {k.replace(new, old): v for k, v in GPT(config).state_dict().items()}
    with pytest.raises(RuntimeError, match=old.replace(".", r"\.")):
        GPT(config).load_state_dict(state)


def test_transformer_from_torch_takes_block_overrides():
    torch.manual_seed(0)
    m = torch.nn.Transformer(16, 2, 1, 1, 32, dropout=0.0, batch_first=True)
    emb = torch.nn.Embedding(9, 16)
    ours = Transformer.from_torch(m, emb, positions={"kind": "learned"}, max_len=12,
                                  block={"similarity": "dot"})
    assert ours.config.block.d_model == 16 and ours.config.positions.kind == "learned"
    assert ours.config.max_len == 12
