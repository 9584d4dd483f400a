"""Token labels: byte-level, SentencePiece and WordPiece markers undone, whitespace visible,
specials by name, never a bare id."""

from __future__ import annotations

import pytest

from qkv.data.tokenizers import BPETokenizer, CharTokenizer
from qkv.viz.labels import readable, token_labels


@pytest.mark.parametrize("raw, kwargs, label", [
    ("Ġthe", {"byte_level": True}, "\u2423the"),
    ("Ċ", {"byte_level": True}, "\u23ce"),
    ("ĊĊ", {"byte_level": True}, "\u23ce\u23ce"),
    ("Ã©", {"byte_level": True}, "é"),
    ("â", {"byte_level": True}, "\\xe2"),  # a piece of a multi-byte character
    ("▁the", {}, "\u2423the"),
    ("<0x0A>", {}, "\u23ce"),
    ("##ing", {}, "\u00b7ing"),
    ("café", {}, "café"),
    ("<|im_start|>", {"special": True}, "<|im_start|>"),
])
def test_readable(raw, kwargs, label):
    assert readable(raw, **kwargs) == label


class VocabularyTokenizer:
    """The interface ``qkv.models.load_pretrained`` tokenizers offer, over a fixed vocabulary."""

    def __init__(self, vocab, specials):
        self.vocab, self.special_ids = vocab, specials
        self.index = {s: i for i, s in enumerate(vocab)}

    def encode(self, text):
        return [self.index["Ġa"], self.index["Ġx"]] if text == " a x" else []

    def token_strings(self, ids):
        return [self.vocab[i] for i in ids]


def test_byte_level_vocabulary_and_specials():
    tok = VocabularyTokenizer(["<|im_start|>", "Hello", "Ġa", "Ġx", "Ã©", "Ċ"], {0})
    assert token_labels(tok, [0, 1, 2, 4, 5]) == ["<|im_start|>", "Hello", "\u2423a", "é",
                                                  "\u23ce"]
    # No Ġ among the ids themselves: the tokenizer is asked how it writes " a x".
    assert token_labels(tok, [1, 4]) == ["Hello", "é"]


def test_wordpiece_vocabulary_is_not_mistaken_for_bytes():
    tok = VocabularyTokenizer(["[CLS]", "caf", "##é", "[SEP]", "a", "x"], {0, 3})
    tok.encode = lambda text: [4, 5]
    assert token_labels(tok, [0, 1, 2, 3]) == ["[CLS]", "caf", "\u00b7é", "[SEP]"]


def test_qkv_tokenizers():
    chars = CharTokenizer.train(["ab c"])
    assert token_labels(chars, [1, *chars.encode("a c"), 0]) == ["<bos>", "a", "\u2423", "c",
                                                                 "<pad>"]
    bpe = BPETokenizer.train(["the cat sat on the mat " * 20], 60)
    labels = token_labels(bpe, bpe.encode("the cat"))
    assert "".join(labels) == "\u2423the\u2423cat"
