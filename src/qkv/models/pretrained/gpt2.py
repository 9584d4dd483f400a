"""Hugging Face GPT-2 directories (config.json + model.safetensors) as a qkv GPT."""

from __future__ import annotations

from ...nn.blocks import BlockConfig
from ...nn.positions import PositionsConfig
from ..configs import GPTConfig
from .files import CheckpointError, TensorSource, fill

# Hugging Face activation names -> qkv FeedForward activations.
ACTIVATIONS = {
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu": "gelu", "relu": "relu",
}
# Buffers older transformers versions saved with the weights; they hold no parameters.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def config_from_hf(hf: dict):
    """A Hugging Face GPT-2 config dict -> GPTConfig; refuses options qkv does not compute."""
    if hf.get("model_type") != "gpt2":
        raise CheckpointError(f"expected model_type 'gpt2'; got {hf.get('model_type')!r}")
    for key, required in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
        if hf.get(key, required) != required:
            raise CheckpointError(f"config {key}={hf[key]!r} is not supported")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise CheckpointError(f"activation_function {activation!r} is not supported; expected "
                              f"one of {sorted(ACTIVATIONS)}")
    try:
        d_model = hf["n_embd"]
        block = BlockConfig(
            d_model=d_model, n_head=hf["n_head"], d_ff=hf.get("n_inner") or 4 * d_model,
            ffn=ACTIVATIONS[activation], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            norm="layernorm", bias=True,
        )
        return GPTConfig(
            vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
            tie_embeddings=hf.get("tie_word_embeddings", True), block=block,
            positions=PositionsConfig(kind="learned"),
        )
    except KeyError as missing:
        raise CheckpointError(f"config.json lacks {missing}") from None


def normalize_names(tensors: dict) -> dict:
    return {name.removeprefix("transformer."): t for name, t in tensors.items()
            if not name.endswith(IGNORED_SUFFIXES)}


def _tensor_names(config) -> dict[str, str]:
    """qkv parameter name -> Hugging Face tensor name (without the 'transformer.' prefix)."""
    names = {"tok_emb.weight": "wte.weight", "positions.table.weight": "wpe.weight",
             "norm.weight": "ln_f.weight", "norm.bias": "ln_f.bias"}
    for i in range(config.n_layer):
        h, b = f"h.{i}.", f"blocks.{i}."
        names.update({
            b + "attn_sublayer.norm.weight": h + "ln_1.weight",
            b + "attn_sublayer.norm.bias": h + "ln_1.bias",
            b + "ffn_sublayer.norm.weight": h + "ln_2.weight",
            b + "ffn_sublayer.norm.bias": h + "ln_2.bias",
            b + "self_attn.out_proj.weight": h + "attn.c_proj.weight",
            b + "self_attn.out_proj.bias": h + "attn.c_proj.bias",
            b + "ffn.up_proj.weight": h + "mlp.c_fc.weight",
            b + "ffn.up_proj.bias": h + "mlp.c_fc.bias",
            b + "ffn.down_proj.weight": h + "mlp.c_proj.weight",
            b + "ffn.down_proj.bias": h + "mlp.c_proj.bias",
        })
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def load_weights(model, source: TensorSource) -> None:
    """Copy every parameter of a GPT-2-shaped ``model`` from ``source``; a sharded parameter
    takes this rank's part (``fill``)."""
    config, d = model.config, model.config.block.d_model
    params = dict(model.named_parameters(remove_duplicate=False))
    for ours, theirs in _tensor_names(config).items():
        shape = tuple(params[ours].shape)
        # Conv1D keeps weights as (in, out); nn.Linear as (out, in).
        conv1d = theirs.endswith(("c_proj.weight", "c_fc.weight"))
        t = source.take(theirs, shape[::-1] if conv1d else shape)
        fill(params[ours], t.T if conv1d else t)
    for i, block in enumerate(model.blocks):
        attn = block.self_attn
        w = source.take(f"h.{i}.attn.c_attn.weight", (d, 3 * d)).T.chunk(3)
        bias = source.take(f"h.{i}.attn.c_attn.bias", (3 * d,)).chunk(3)
        for proj, wi, bi in zip((attn.q_proj, attn.k_proj, attn.v_proj), w, bias, strict=True):
            fill(proj.weight, wi)
            fill(proj.bias, bi)
    source.discard("lm_head.weight")  # the tied copy, when a writer kept it
    source.finish()
