"""Read a Hugging Face GPT-2 directory (config.json + model.safetensors) into a qkv GPT.

Only safetensors is read: a pickle checkpoint (pytorch_model.bin, *.pt) can run code when
loaded, so it is refused with a message saying how to convert it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor

# Hugging Face activation names -> qkv FeedForward activations.
_ACTIVATIONS = {
    "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu": "gelu", "relu": "relu",
}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Buffers older transformers versions saved with the weights; they hold no parameters.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _refuse_pickle(path: Path) -> None:
    raise ValueError(
        f"{path} is a pickle checkpoint; qkv reads safetensors only, because unpickling can run "
        "arbitrary code. Convert it where you trust it: load it with transformers and call "
        "save_pretrained(dir, safe_serialization=True)."
    )


def _files(path) -> tuple[Path, Path]:
    path = Path(path)
    if path.is_file():
        if path.suffix in _PICKLE_SUFFIXES:
            _refuse_pickle(path)
        raise ValueError(f"from_pretrained expects a directory with config.json and "
                         f"model.safetensors; got the file {path}")
    if not path.is_dir():
        raise ValueError(f"from_pretrained: no such directory: {path}")
    config, weights = path / "config.json", path / "model.safetensors"
    if not weights.exists():
        pickles = sorted(p for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            _refuse_pickle(pickles[0])
        raise ValueError(f"from_pretrained: {path} has no model.safetensors")
    if not config.exists():
        raise ValueError(f"from_pretrained: {path} has no config.json")
    return config, weights


def gpt_config_from_hf(hf: dict):
    """A Hugging Face GPT-2 config dict -> GPTConfig; refuses options qkv does not compute."""
    from .gpt import GPTConfig

    if hf.get("model_type") != "gpt2":
        raise ValueError(f"from_pretrained reads GPT-2 (model_type 'gpt2'); got "
                         f"{hf.get('model_type')!r}")
    for key, required in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                          ("add_cross_attention", False)):
        if hf.get(key, required) != required:
            raise ValueError(f"from_pretrained: config {key}={hf[key]!r} is not supported")
    activation = hf.get("activation_function", "gelu_new")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"from_pretrained: activation_function {activation!r} is not supported; "
                         f"expected one of {sorted(_ACTIVATIONS)}")
    try:
        d_model = hf["n_embd"]
        return GPTConfig(
            vocab_size=hf["vocab_size"], block_size=hf["n_positions"], n_layer=hf["n_layer"],
            n_head=hf["n_head"], d_model=d_model, d_ff=hf.get("n_inner") or 4 * d_model,
            ffn=_ACTIVATIONS[activation], norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=hf.get("tie_word_embeddings", True), positions="learned",
            norm="layernorm", bias=True,
        )
    except KeyError as missing:
        raise ValueError(f"from_pretrained: config.json lacks {missing}") from None


def _hf_tensors(config) -> dict[str, str]:
    """qkv parameter name -> Hugging Face tensor name (without the 'transformer.' prefix).
    Conv1D weights are stored (in, out); the ones marked by ``_TRANSPOSED`` need a transpose."""
    names = {"tok_emb.weight": "wte.weight", "positions.learned.table.weight": "wpe.weight",
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
            b + "ffn.linear1.weight": h + "mlp.c_fc.weight",
            b + "ffn.linear1.bias": h + "mlp.c_fc.bias",
            b + "ffn.linear2.weight": h + "mlp.c_proj.weight",
            b + "ffn.linear2.bias": h + "mlp.c_proj.bias",
        })
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _normalize_names(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    out = {}
    for name, t in tensors.items():
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        out[name.removeprefix("transformer.")] = t
    return out


def _take(tensors: dict[str, Tensor], name: str, shape: tuple[int, ...]) -> Tensor:
    if name not in tensors:
        raise ValueError(f"from_pretrained: model.safetensors lacks tensor {name!r}")
    t = tensors.pop(name)
    if tuple(t.shape) != shape:
        raise ValueError(f"from_pretrained: tensor {name!r} has shape {tuple(t.shape)}; the "
                         f"config implies {shape}")
    return t


def load_gpt2(cls, path):
    from safetensors.torch import load_file

    config_file, weights_file = _files(path)
    config = gpt_config_from_hf(json.loads(config_file.read_text()))
    tensors = _normalize_names(load_file(str(weights_file)))
    model = cls(config)
    params = dict(model.named_parameters(remove_duplicate=False))
    d = config.d_model
    with torch.no_grad():
        for ours, theirs in _hf_tensors(config).items():
            shape = tuple(params[ours].shape)
            # Conv1D keeps weights as (in, out); nn.Linear as (out, in).
            conv1d = theirs.endswith(("c_proj.weight", "c_fc.weight"))
            t = _take(tensors, theirs, shape[::-1] if conv1d else shape)
            params[ours].copy_(t.T if conv1d else t)
        for i, block in enumerate(model.blocks):
            attn = block.self_attn
            w = _take(tensors, f"h.{i}.attn.c_attn.weight", (d, 3 * d)).T.chunk(3)
            bias = _take(tensors, f"h.{i}.attn.c_attn.bias", (3 * d,)).chunk(3)
            for proj, wi, bi in zip((attn.q_proj, attn.k_proj, attn.v_proj), w, bias, strict=True):
                proj.weight.copy_(wi)
                proj.bias.copy_(bi)
    tensors.pop("lm_head.weight", None)  # the tied copy, when a writer kept it
    if tensors:
        raise ValueError(f"from_pretrained: unexpected tensors in model.safetensors: "
                         f"{sorted(tensors)[:5]}")
    return model
