"""BERT-family directories (BertModel: config.json + model.safetensors) as a qkv Encoder.

BERT is the paper's post-norm encoder with learned positions, token-type embeddings, a
LayerNorm after the embeddings and exact GELU. A sentence-transformers directory also says
how to pool (``1_Pooling/config.json``) and whether to normalize (``modules.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...nn.blocks import BlockConfig
from ...nn.positions import PositionsConfig
from ..configs import EncoderConfig
from .files import CheckpointError, TensorSource

ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
               "relu": "relu"}
# qkv parameter (after "blocks.{i}.") -> Hugging Face name (after "encoder.layer.{i}.")
LAYER_TENSORS = {
    "self_attn.q_proj": "attention.self.query",
    "self_attn.k_proj": "attention.self.key",
    "self_attn.v_proj": "attention.self.value",
    "self_attn.out_proj": "attention.output.dense",
    "attn_sublayer.norm": "attention.output.LayerNorm",
    "ffn.up_proj": "intermediate.dense",
    "ffn.down_proj": "output.dense",
    "ffn_sublayer.norm": "output.LayerNorm",
}
MODEL_TENSORS = {
    "tok_emb": "embeddings.word_embeddings",
    "positions.table": "embeddings.position_embeddings",
    "type_emb": "embeddings.token_type_embeddings",
    "embed_norm": "embeddings.LayerNorm",
}
# Tensors BertModel keeps that a headless encoder does not use: the NSP pooler and a buffer.
UNUSED = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")


def sentence_pooling(directory: Path) -> tuple[str, bool]:
    """(pooling, normalize) from sentence-transformers' files; BERT's defaults without them."""
    pooling, normalize = "mean", False
    pooling_file = directory / "1_Pooling" / "config.json"
    if pooling_file.is_file():
        modes = json.loads(pooling_file.read_text())
        chosen = [k for k, v in modes.items() if k.startswith("pooling_mode_") and v]
        if chosen not in (["pooling_mode_mean_tokens"], ["pooling_mode_cls_token"]):
            raise CheckpointError(f"{pooling_file}: pooling {chosen} is not supported; "
                                  "expected mean tokens or the CLS token")
        pooling = "mean" if chosen == ["pooling_mode_mean_tokens"] else "first"
    modules_file = directory / "modules.json"
    if modules_file.is_file():
        types = [m.get("type", "") for m in json.loads(modules_file.read_text())]
        normalize = any(t.endswith(".Normalize") for t in types)
    return pooling, normalize


def config_from_hf(hf: dict, pooling: str, normalize: bool):
    if hf.get("model_type") != "bert":
        raise CheckpointError(f"expected model_type 'bert'; got {hf.get('model_type')!r}")
    heads = [a for a in hf.get("architectures") or [] if a != "BertModel"]
    if heads:
        raise CheckpointError(f"architecture {heads[0]} is not supported; qkv reads the "
                              "headless BertModel (hidden states and sentence embeddings)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise CheckpointError(f"position_embedding_type {hf['position_embedding_type']!r} is "
                              "not supported (expected 'absolute')")
    act = hf.get("hidden_act", "gelu")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"hidden_act {act!r} is not supported; expected one of "
                              f"{sorted(ACTIVATIONS)}")
    try:
        block = BlockConfig(
            d_model=hf["hidden_size"], n_head=hf["num_attention_heads"],
            d_ff=hf["intermediate_size"], dropout=hf.get("hidden_dropout_prob", 0.1),
            norm="layernorm", norm_first=False, ffn=ACTIVATIONS[act],
            norm_eps=hf.get("layer_norm_eps", 1e-12),
        )
        return EncoderConfig(
            vocab_size=hf["vocab_size"], num_classes=0, max_len=hf["max_position_embeddings"],
            n_layer=hf["num_hidden_layers"], block=block,
            positions=PositionsConfig(kind="learned"), pooling=pooling,
            pad_id=hf.get("pad_token_id", 0), type_vocab_size=hf.get("type_vocab_size", 2),
            embed_norm=True, normalize=normalize,
        )
    except KeyError as missing:
        raise CheckpointError(f"config.json lacks {missing}") from None


def load_weights(model, source: TensorSource) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        pairs = list(MODEL_TENSORS.items()) + [
            (f"blocks.{i}.{ours}", f"encoder.layer.{i}.{theirs}")
            for i in range(model.config.n_layer) for ours, theirs in LAYER_TENSORS.items()
        ]
        for ours, theirs in pairs:
            for suffix in (".weight", ".bias"):
                if ours + suffix not in params:  # embeddings have no bias
                    continue
                target = params[ours + suffix]
                target.copy_(source.take(theirs + suffix, tuple(target.shape)))
    source.discard(*UNUSED)
    source.finish()
