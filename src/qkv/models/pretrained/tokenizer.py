"""Tokenizers of pretrained checkpoints: ``tokenizer.json`` directories and GGUF metadata.

Both become a Hugging Face ``tokenizers.Tokenizer`` (the Rust implementation the checkpoints
were made with) inside ``PretrainedTokenizer``, which adds the special ids and the chat
template. Chat templates are Jinja, rendered in a sandbox (a template is data, not code).
"""

from __future__ import annotations

import json
from pathlib import Path

from ...data.pretrained_tokenizer import PretrainedTokenizer
from .files import CheckpointError

CONTROL, USER_DEFINED = 3, 4  # GGUF token types

# tokenizer.ggml.pre -> how text is split before byte-level BPE. "smollm" splits every digit
# on its own first, as its tokenizer was trained (llama.cpp does the same).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def from_directory(directory: Path) -> PretrainedTokenizer:
    """tokenizer.json, with tokenizer_config.json / special_tokens_map.json when present."""
    from tokenizers import Tokenizer

    file = directory / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{directory} has no tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust parser raises its own exception type
        raise CheckpointError(f"{file} is not a readable tokenizer: {e}") from None
    config: dict = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            config.update(json.loads((directory / name).read_text(encoding="utf-8")))
    bos = _token_text(config.get("bos_token")) or _token_text(config.get("cls_token"))
    eos = _token_text(config.get("eos_token")) or _token_text(config.get("sep_token"))
    template = config.get("chat_template")
    if (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    # A tokenizer.json whose post-processor already adds BOS must not get a second one.
    add_bos = bool(config.get("add_bos_token")) and tokenizer.post_processor is None
    pad = _token_text(config.get("pad_token"))
    result = PretrainedTokenizer(tokenizer, bos=bos, eos=eos, pad=pad, add_bos=add_bos,
                                 chat_template=template)
    # sentence-transformers' limit (256 for all-MiniLM-L6-v2) is the one its embeddings use.
    sentence_config = directory / "sentence_bert_config.json"
    if sentence_config.is_file():
        result.max_length = json.loads(sentence_config.read_text()).get("max_seq_length")
    return result


def from_gguf(meta) -> PretrainedTokenizer:
    """A byte-level BPE tokenizer from GGUF metadata (tokens, merges, token types, specials)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"{meta.path}: tokenizer.ggml.model {kind!r} is not supported; "
                              "qkv reads byte-level BPE ('gpt2') GGUF tokenizers")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise CheckpointError(f"{meta.path}: tokenizer.ggml.pre {pre!r} is not supported; "
                              f"expected one of {GGUF_PRE_TOKENIZERS}")
    tokens = list(meta.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    try:
        bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
    except Exception as e:  # the Rust side raises a bare Exception ("Token `x` out of vocab")
        raise CheckpointError(f"{meta.path}: tokenizer.ggml.merges do not fit "
                              f"tokenizer.ggml.tokens: {e}") from None
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("llama-bpe", "llama3"):
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    types = list(meta.get("tokenizer.ggml.token_type") or [0] * len(tokens))
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types, strict=True)
                                  if kind == CONTROL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types, strict=True)
                          if kind == USER_DEFINED])

    def token(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    return PretrainedTokenizer(
        tokenizer, bos=token("bos_token_id"), eos=token("eos_token_id"),
        pad=token("padding_token_id"), add_bos=bool(meta.get("tokenizer.ggml.add_bos_token")),
        chat_template=meta.get("tokenizer.chat_template"))
