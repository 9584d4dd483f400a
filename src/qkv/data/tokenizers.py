"""Tokenizers: character-level, and BPE trained locally with Hugging Face ``tokenizers``.

Both reserve the same special ids (pad 0, bos 1, eos 2, unk 3) and save to / load from one
JSON file, so a run directory can rebuild them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .atomic import write_json_atomic
from .errors import DataError
from .pretrained_tokenizer import PretrainedTokenizer

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)


class CharTokenizer:
    """One id per character seen in training; unseen characters map to <unk>."""

    kind = "char"
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, chars: list[str]):
        self.chars = list(chars)
        self.index = {c: i + len(SPECIALS) for i, c in enumerate(self.chars)}

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int | None = None) -> CharTokenizer:
        """All distinct characters, sorted (``vocab_size`` is ignored: the text decides it)."""
        chars: set[str] = set()
        for t in texts:
            chars.update(t)
        return cls(sorted(chars))

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str) -> list[int]:
        return [self.index.get(c, UNK_ID) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        n = len(SPECIALS)
        return "".join(self.chars[i - n] for i in ids if i >= n and i - n < len(self.chars))

    def to_json(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}


class BPETokenizer:
    """Byte-pair encoding learned on the training text, with Metaspace pre-tokenization so
    decoding restores the spaces exactly."""

    kind = "bpe"
    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 1000) -> BPETokenizer:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False
        )
        tokenizer.train_from_iterator(list(texts), trainer=trainer)
        return cls(tokenizer)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def to_json(self) -> dict:
        return {"kind": self.kind, "tokenizer": json.loads(self.tokenizer.to_str())}


KINDS = {"char": CharTokenizer, "bpe": BPETokenizer}


def train_tokenizer(kind: str, texts: Iterable[str], vocab_size: int):
    if kind not in KINDS:
        raise ValueError(f"tokenizer: expected one of {sorted(KINDS)}, got {kind!r}")
    return KINDS[kind].train(texts, vocab_size)


def save_tokenizer(tokenizer, path: str | Path) -> None:
    write_json_atomic(path, tokenizer.to_json())


def tokenizer_from_json(data: dict, where: str = "tokenizer"):
    """The tokenizer ``to_json`` described; ``where`` names the source in errors."""
    kind = data.get("kind") if isinstance(data, dict) else None
    try:
        if kind == "char":
            return CharTokenizer(list(data["chars"]))
        if kind == "bpe":
            from tokenizers import Tokenizer

            return BPETokenizer(Tokenizer.from_str(json.dumps(data["tokenizer"])))
        if kind == "pretrained":  # a checkpoint's tokenizer, kept by a run started from it
            return PretrainedTokenizer.from_json(data)
    except Exception as e:  # the Hugging Face parser raises a bare Exception on a bad file
        raise DataError(f"{where} is not a readable {kind} tokenizer: {e}") from None
    raise DataError(f"{where} is not a qkv tokenizer file (kind {kind!r})")


def read_tokenizer(path: str | Path):
    """A tokenizer saved by ``save_tokenizer`` (a run's ``tokenizer*.json``); a missing or
    corrupt file is named. A checkpoint's tokenizer: ``qkv.models.load_tokenizer``."""
    where = repr(str(path))
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"tokenizer file {where} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"tokenizer file {where} is corrupt: {e}") from None
    return tokenizer_from_json(data, f"tokenizer file {where}")
