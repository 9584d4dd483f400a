"""Real pretrained checkpoints as qkv models: GPT-2 and LLaMA-family decoders (Hugging Face
directories and GGUF files) as ``GPT``, BERT-family encoders as ``Encoder``, and their
tokenizers.

    model, tokenizer = load_pretrained("smollm2")       # or "minilm", or a path
    GPT.from_pretrained("path/to/llama-dir")            # the model alone
    load_tokenizer("path/to/model.gguf")                # the tokenizer alone

Only safetensors and GGUF are read; nothing is unpickled and nothing is downloaded.
"""

from __future__ import annotations

import functools
from pathlib import Path

from . import bert, gpt2, llama
from .files import (
    SHORT_NAMES,
    CheckpointError,
    TensorSource,
    read_config,
    read_safetensors,
    resolve,
)
from .gguf import GGUFFile
from .tokenizer import PretrainedTokenizer, from_directory, from_gguf

__all__ = ["SHORT_NAMES", "CheckpointError", "PretrainedTokenizer", "load_encoder", "load_gpt",
           "load_gpt_config", "load_pretrained", "load_tokenizer", "resolve"]

DECODER_TYPES = ("gpt2", "llama")


@functools.lru_cache(maxsize=2)
def _gguf(path: Path, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: Path) -> GGUFFile:
    """The parsed file, parsed once per process (the vocabulary arrays take seconds) while the
    file is unchanged; the tensors stay memory-mapped."""
    return _gguf(path.resolve(), path.stat().st_mtime_ns)


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def _model_type(path: Path) -> str:
    if _is_gguf(path):
        return "gguf"
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a checkpoint directory (config.json + "
                              "model.safetensors) or a .gguf file")
    return str(read_config(path).get("model_type"))


def load_gpt_config(name_or_path):
    """The GPTConfig of a decoder checkpoint, without reading its weights."""
    path = resolve(name_or_path)
    kind = _model_type(path)
    if kind == "gguf":
        meta = open_gguf(path)
        return llama.config_from_gguf(meta, has_output="output.weight" in meta.names())
    if kind not in DECODER_TYPES:
        raise CheckpointError(f"{path}: model_type {kind!r} is not a decoder qkv reads as GPT; "
                              f"expected one of {DECODER_TYPES} or a .gguf file")
    return (gpt2 if kind == "gpt2" else llama).config_from_hf(read_config(path))


def load_gpt(name_or_path):
    """A GPT from a GPT-2 or LLaMA-family directory, a ``.gguf`` file, or ``smollm2``."""
    from ..gpt import GPT

    path = resolve(name_or_path)
    model = GPT(load_gpt_config(path))
    kind, where = _model_type(path), str(path)
    if kind == "gguf":
        llama.load_weights(model, TensorSource(open_gguf(path).tensors(), where), gguf=True)
    elif kind == "gpt2":
        tensors = gpt2.normalize_names(read_safetensors(path))
        gpt2.load_weights(model, TensorSource(tensors, where))
    else:
        llama.load_weights(model, TensorSource(read_safetensors(path), where), gguf=False)
    return model.eval()


def load_encoder(name_or_path):
    """An Encoder (no head) from a BERT-family directory or ``minilm``."""
    from ..encoder import Encoder

    path = resolve(name_or_path)
    kind = _model_type(path)
    if kind != "bert":
        raise CheckpointError(f"{path}: model_type {kind!r} is not an encoder qkv reads; "
                              "expected 'bert'")
    config = bert.config_from_hf(read_config(path), *bert.sentence_pooling(path))
    tensors = {name.removeprefix("bert."): t for name, t in read_safetensors(path).items()}
    model = Encoder(config)
    bert.load_weights(model, TensorSource(tensors, str(path)))
    return model.eval()


def load_tokenizer(name_or_path) -> PretrainedTokenizer:
    """The tokenizer of a checkpoint: its tokenizer.json, or a GGUF file's metadata."""
    path = resolve(name_or_path)
    if _is_gguf(path):
        return from_gguf(open_gguf(path))
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not path.is_dir():
        raise CheckpointError(f"{path}: expected a directory with tokenizer.json or a .gguf file")
    return from_directory(path)


def load_pretrained(name_or_path):
    """(model, tokenizer) of a checkpoint: a GPT for decoders, an Encoder for BERT. The
    tokenizer is None when a directory holds none."""
    path = resolve(name_or_path)
    model = load_encoder(path) if _model_type(path) == "bert" else load_gpt(path)
    has_tokenizer = _is_gguf(path) or (path / "tokenizer.json").is_file()
    return model, (load_tokenizer(path) if has_tokenizer else None)
