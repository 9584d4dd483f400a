"""Tokenizers of pretrained checkpoints: ``tokenizer.json`` directories and GGUF metadata.

Both become a Hugging Face ``tokenizers.Tokenizer`` (the Rust implementation the checkpoints
were made with) inside ``PretrainedTokenizer``, which adds the special ids and the chat
template. Chat templates are Jinja, rendered in a sandbox (a template is data, not code).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .files import CheckpointError

CONTROL, USER_DEFINED = 3, 4  # GGUF token types

# tokenizer.ggml.pre -> how text is split before byte-level BPE. "smollm" splits every digit
# on its own first, as its tokenizer was trained (llama.cpp does the same).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GGUF_PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")


class PretrainedTokenizer:
    """A checkpoint's tokenizer: ``encode``, ``decode``, ``token_strings`` and, for chat
    models, ``apply_chat_template``.

    ``encode(text)`` adds the special tokens the checkpoint's own tokenizer adds by default
    (BERT's [CLS] ... [SEP], a BOS where the checkpoint asks for one)."""

    kind = "pretrained"

    def __init__(self, tokenizer, *, bos: str | None = None, eos: str | None = None,
                 pad: str | None = None, add_bos: bool = False, chat_template: str | None = None):
        self.tokenizer = tokenizer
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.bos_id, self.eos_id, self.pad_id = (self._id(t) for t in (bos, eos, pad))
        self.bos, self.eos, self.pad = bos, eos, pad
        self.add_bos, self.chat_template = add_bos, chat_template
        self.max_length: int | None = None  # the checkpoint's own input limit, when it has one
        unk = getattr(tokenizer.model, "unk_token", None)
        # What an empty prompt starts from (qkv's lm task): the unknown token, else BOS/EOS.
        self.unk_id = next((i for i in (self._id(unk), self.bos_id, self.eos_id)
                            if i is not None), 0)
        self.special_ids = {
            i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True,
               max_length: int | None = None) -> list[int]:
        """text -> ids; ``max_length`` truncates (keeping the special tokens it adds)."""
        if max_length is not None:
            self.tokenizer.enable_truncation(max_length)
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self.tokenizer.no_truncation()
        if add_special_tokens and self.add_bos and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """The vocabulary's own spelling of each id ('Ġthe', '##ing', '<|im_start|>')."""
        return [self.tokenizer.id_to_token(int(i)) or f"<{int(i)}>" for i in ids]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """messages [{"role": ..., "content": ...}, ...] -> the prompt text the model expects."""
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat template (not a chat model)")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos or "", eos_token=self.eos or "")

    def to_json(self) -> dict:
        return {"kind": self.kind, "tokenizer": json.loads(self.tokenizer.to_str()),
                "bos": self.bos, "eos": self.eos, "pad": self.pad, "add_bos": self.add_bos,
                "chat_template": self.chat_template}

    @classmethod
    def from_json(cls, data: dict) -> PretrainedTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(json.dumps(data["tokenizer"])), bos=data.get("bos"),
                   eos=data.get("eos"), pad=data.get("pad"), add_bos=data.get("add_bos", False),
                   chat_template=data.get("chat_template"))


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
