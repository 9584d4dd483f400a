"""Real pretrained checkpoints as qkv models: GPT-2 and LLaMA-family decoders (Hugging Face
directories and GGUF files) as ``GPT``, BERT-family encoders as ``Encoder``, and their
tokenizers.

    model, tokenizer = qkv.models.load_pretrained("smollm2")   # or "minilm", or a path
    GPT.from_pretrained("path/to/llama-dir")                    # the model alone
    load_gpt_weights(model, "smollm2")                          # into a model, in place
    load_tokenizer("path/to/model.gguf")                        # the tokenizer alone

``gpt_from_pretrained`` and ``encoder_from_pretrained`` are what ``GPT.from_pretrained`` and
``Encoder.from_pretrained`` call: the model class comes in as an argument, so this package
reads checkpoints into configs and weights without importing the models.

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
    built_on_meta,
    built_to_load,
    check_filled,
    fill,
    is_dtensor,
    materialize,
    read_config,
    read_safetensors,
    resolve,
    safetensors_readers,
)
from .gguf import GGUFFile
from .tokenizer import PretrainedTokenizer, from_directory, from_gguf

__all__ = ["SHORT_NAMES", "CheckpointError", "PretrainedTokenizer", "built_on_meta",
           "encoder_from_pretrained", "fill", "gpt_from_pretrained", "is_dtensor", "is_encoder",
           "load_gpt_config", "load_gpt_weights", "load_tokenizer", "materialize", "resolve"]

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


def _fill_gpt(model, path: Path, lazy: bool) -> None:
    """Copy the decoder checkpoint at ``path`` into ``model`` (built from its config); with
    ``lazy``, each tensor is read from the file as it is copied, so one is held at a time."""
    kind, where = _model_type(path), str(path)
    if kind == "gguf":
        gguf = open_gguf(path)
        tensors = gguf.readers() if lazy else gguf.tensors()
        llama.load_weights(model, TensorSource(tensors, where), gguf=True)
        return
    tensors = safetensors_readers(path) if lazy else read_safetensors(path)
    if kind == "gpt2":
        gpt2.load_weights(model, TensorSource(gpt2.normalize_names(tensors), where))
    else:
        llama.load_weights(model, TensorSource(tensors, where), gguf=False)


def gpt_from_pretrained(cls, name_or_path):
    """``cls(config)`` (a GPT) with the weights of a GPT-2 or LLaMA-family directory, a
    ``.gguf`` file, or ``smollm2``, in eval mode."""
    path = resolve(name_or_path)
    model = built_to_load(lambda: cls(load_gpt_config(path)))
    _fill_gpt(model, path, lazy=False)
    check_filled(model, str(path))
    return model.eval()


def load_gpt_weights(model, name_or_path) -> None:
    """Fill ``model``, a GPT of the checkpoint's config, with its weights, in place, reading
    one tensor at a time: a model whose parameters FSDP has sharded (built with
    ``built_on_meta``, then materialized) takes this rank's part of each, so no rank holds
    the whole checkpoint. Every parameter must be written."""
    path = resolve(name_or_path)
    _fill_gpt(model, path, lazy=True)
    check_filled(model, str(path))


def encoder_from_pretrained(cls, name_or_path):
    """``cls(config)`` (an Encoder, no head) with the weights of a BERT-family directory or
    ``minilm``, in eval mode."""
    path = resolve(name_or_path)
    kind = _model_type(path)
    if kind != "bert":
        raise CheckpointError(f"{path}: model_type {kind!r} is not an encoder qkv reads; "
                              "expected 'bert'")
    config = bert.config_from_hf(read_config(path), *bert.sentence_pooling(path))
    tensors = {name.removeprefix("bert."): t for name, t in read_safetensors(path).items()}
    model = built_to_load(lambda: cls(config))
    bert.load_weights(model, TensorSource(tensors, str(path)))
    check_filled(model, str(path))
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


def is_encoder(name_or_path) -> bool:
    """Whether the checkpoint is an encoder (BERT) rather than a decoder."""
    return _model_type(resolve(name_or_path)) == "bert"


def has_tokenizer(name_or_path) -> bool:
    path = resolve(name_or_path)
    return _is_gguf(path) or (path / "tokenizer.json").is_file()
