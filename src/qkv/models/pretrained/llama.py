"""LLaMA-family decoders (LlamaForCausalLM directories and GGUF files) as a qkv GPT.

The architecture is GPT with rotary positions (rotate-half layout), RMSNorm, SwiGLU, no
biases and grouped key/value heads. GGUF stores W^Q and W^K with the rows of each head
interleaved for llama.cpp's rotary layout; ``unpermute_rows`` undoes that.
"""

from __future__ import annotations

from torch import Tensor

from ...nn.blocks import BlockConfig
from ...nn.positions import PositionsConfig
from ..configs import GPTConfig
from .files import CheckpointError, TensorSource, fill

# qkv parameter (after "blocks.{i}.") -> (Hugging Face name after "model.layers.{i}.", GGUF
# name after "blk.{i}.")
LAYER_TENSORS = {
    "attn_sublayer.norm.weight": ("input_layernorm.weight", "attn_norm.weight"),
    "self_attn.q_proj.weight": ("self_attn.q_proj.weight", "attn_q.weight"),
    "self_attn.k_proj.weight": ("self_attn.k_proj.weight", "attn_k.weight"),
    "self_attn.v_proj.weight": ("self_attn.v_proj.weight", "attn_v.weight"),
    "self_attn.out_proj.weight": ("self_attn.o_proj.weight", "attn_output.weight"),
    "ffn_sublayer.norm.weight": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "ffn.gate_proj.weight": ("mlp.gate_proj.weight", "ffn_gate.weight"),
    "ffn.up_proj.weight": ("mlp.up_proj.weight", "ffn_up.weight"),
    "ffn.down_proj.weight": ("mlp.down_proj.weight", "ffn_down.weight"),
}
MODEL_TENSORS = {
    "tok_emb.weight": ("model.embed_tokens.weight", "token_embd.weight"),
    "norm.weight": ("model.norm.weight", "output_norm.weight"),
    "lm_head.weight": ("lm_head.weight", "output.weight"),
}


def _gpt_config(*, vocab_size, block_size, n_layer, tie_embeddings, rope_base, **block):
    """LLaMA's GPT: rotary positions, RMSNorm, SwiGLU and no biases."""
    return GPTConfig(
        vocab_size=vocab_size, block_size=block_size, n_layer=n_layer,
        tie_embeddings=tie_embeddings,
        block=BlockConfig(norm="rmsnorm", ffn="swiglu", bias=False, **block),
        positions=PositionsConfig(kind="rope", rope_base=rope_base),
    )


def config_from_hf(hf: dict):
    """A Hugging Face LlamaConfig dict -> GPTConfig; refuses options qkv does not compute."""
    if hf.get("model_type") != "llama":
        raise CheckpointError(f"expected model_type 'llama'; got {hf.get('model_type')!r}")
    unsupported = {
        "hidden_act": (hf.get("hidden_act", "silu"), "silu"),
        "attention_bias": (hf.get("attention_bias", False), False),
        "mlp_bias": (hf.get("mlp_bias", False), False),
        "rope_scaling": (hf.get("rope_scaling"), None),
    }
    for key, (value, required) in unsupported.items():
        if value != required and not (key == "rope_scaling" and _plain_rope(value)):
            raise CheckpointError(
                f"config {key}={value!r} is not supported (expected {required!r})")
    try:
        d_model, n_head = hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d_model // n_head
        if head_dim * n_head != d_model:
            raise CheckpointError(f"config head_dim={head_dim} * num_attention_heads={n_head} "
                                  f"!= hidden_size={d_model} is not supported")
        return _gpt_config(
            vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 2048),
            n_layer=hf["num_hidden_layers"], n_head=n_head, d_model=d_model,
            n_kv_head=hf.get("num_key_value_heads") or n_head, d_ff=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6), rope_base=_rope_theta(hf),
            tie_embeddings=hf.get("tie_word_embeddings", False),
        )
    except KeyError as missing:
        raise CheckpointError(f"config.json lacks {missing}") from None


def _plain_rope(scaling) -> bool:
    return isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type")) == "default"


def _rope_theta(hf: dict) -> float:
    scaling = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(hf.get("rope_theta") or scaling.get("rope_theta") or 10000.0)


def config_from_gguf(meta, has_output: bool):
    """GGUF metadata (a GGUFFile) of a ``llama`` architecture -> GPTConfig."""
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{meta.path}: architecture {arch!r} is not supported; qkv reads "
                              f"'llama' GGUF files (and GPT-2 / LLaMA / BERT directories)")
    key = lambda name: meta.require(f"llama.{name}")  # noqa: E731
    d_model, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    rope_dims = meta.get("llama.rope.dimension_count", d_model // n_head)
    if rope_dims != d_model // n_head:
        raise CheckpointError(f"{meta.path}: partial rotary ({rope_dims} of {d_model // n_head} "
                              "dimensions) is not supported")
    vocab = meta.get("llama.vocab_size") or len(meta.require("tokenizer.ggml.tokens"))
    return _gpt_config(
        vocab_size=int(vocab), block_size=int(key("context_length")),
        n_layer=int(key("block_count")), n_head=n_head, d_model=d_model,
        n_kv_head=int(meta.get("llama.attention.head_count_kv", n_head)),
        d_ff=int(key("feed_forward_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        rope_base=float(meta.get("llama.rope.freq_base", 10000.0)),
        tie_embeddings=not has_output,
    )


def unpermute_rows(w: Tensor, heads: int) -> Tensor:
    """Undo llama.cpp's rotary row order: within each head, GGUF stores rows as pairs
    (0, D/2), (1, D/2 + 1), ...; Hugging Face (and qkv) keep the halves apart."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_weights(model, source: TensorSource, gguf: bool) -> None:
    """Copy every parameter of a LLaMA-shaped ``model`` from ``source`` (HF or GGUF names);
    a sharded parameter takes this rank's part (``fill``)."""
    c = model.config
    heads, kv_heads = c.block.n_head, c.block.n_kv_head or c.block.n_head
    params = dict(model.named_parameters())
    which = 1 if gguf else 0
    for ours, names in MODEL_TENSORS.items():
        if ours == "lm_head.weight" and c.tie_embeddings:
            source.discard(names[which])  # a tied copy, when a writer kept it
            continue
        fill(params[ours], source.take(names[which], tuple(params[ours].shape)))
    for i in range(c.n_layer):
        prefix = f"blk.{i}." if gguf else f"model.layers.{i}."
        for ours, names in LAYER_TENSORS.items():
            target = params[f"blocks.{i}.{ours}"]
            t = source.take(prefix + names[which], tuple(target.shape))
            if gguf and ours == "self_attn.q_proj.weight":
                t = unpermute_rows(t, heads)
            elif gguf and ours == "self_attn.k_proj.weight":
                t = unpermute_rows(t, kv_heads)
            fill(target, t)
        source.discard(f"{prefix}self_attn.rotary_emb.inv_freq")  # older writers saved it
    source.finish()
