import pytest

from qkv.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    BPETokenizer,
    CharTokenizer,
    read_tokenizer,
    save_tokenizer,
    train_tokenizer,
)

TEXTS = ["dreihundertzwölf", "zweiundvierzig", "one hundred and twelve", "forty-two"]


@pytest.mark.parametrize("kind", ["char", "bpe"])
def test_round_trip_and_json(kind, tmp_path):
    tok = train_tokenizer(kind, TEXTS, 60)
    for text in TEXTS:
        ids = tok.encode(text)
        assert min(ids) > UNK_ID and tok.decode(ids) == text
    assert tok.decode([BOS_ID] + tok.encode("zwölf") + [EOS_ID, PAD_ID]) == "zwölf"
    save_tokenizer(tok, tmp_path / "tok.json")
    again = read_tokenizer(tmp_path / "tok.json")
    assert type(again) is type(tok) and again.vocab_size == tok.vocab_size
    assert again.encode(TEXTS[2]) == tok.encode(TEXTS[2])


def test_char_unknown_and_bpe_merges():
    char = CharTokenizer.train(["ab"])
    assert char.vocab_size == 6 and char.encode("abz") == [4, 5, UNK_ID]
    bpe = BPETokenizer.train(TEXTS * 20, vocab_size=80)
    assert len(bpe.encode("zweiundvierzig")) < len("zweiundvierzig")


def test_bad_kind_and_file(tmp_path):
    with pytest.raises(ValueError, match="tokenizer"):
        train_tokenizer("word", TEXTS, 10)
    (tmp_path / "x.json").write_text('{"kind": "other"}')
    with pytest.raises(ValueError, match="not a qkv tokenizer"):
        read_tokenizer(tmp_path / "x.json")


@pytest.mark.parametrize("content, expected", [
    ("{not json", "is corrupt"),
    ('{"kind": "bpe", "tokenizer": {"model": 3}}', "is not a readable bpe tokenizer"),
    ('{"kind": "char"}', "is not a readable char tokenizer"),
    ("[1, 2]", "is not a qkv tokenizer file"),
])
def test_a_corrupt_tokenizer_file_is_named(tmp_path, content, expected):
    path = tmp_path / "tokenizer.json"
    path.write_text(content)
    with pytest.raises(ValueError) as info:
        read_tokenizer(path)
    message = str(info.value)
    assert message.startswith(f"tokenizer file {str(path)!r}") and expected in message
    assert "\n" not in message
