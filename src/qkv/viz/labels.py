"""Token labels people can read, the same on the page and in the pictures.

Tokenizers keep their vocabulary in encoded forms: byte-level BPE (GPT-2, SmolLM2) writes a
leading space as ``Ġ`` and a newline as ``Ċ``; SentencePiece writes ``▁`` and byte tokens
``<0x0A>``; WordPiece (BERT) marks a word's continuation with ``##``. A label undoes the
encoding and then makes whitespace visible:

    'Ġthe' -> '␣the'    'Ċ' -> '⏎'    '▁the' -> '␣the'    '<0x0A>' -> '⏎'    '##ing' -> '·ing'

Special tokens keep their vocabulary name ('<|im_start|>', '[CLS]'); a token that is only
part of a multi-byte character shows its bytes as \\xNN escapes.
"""

from __future__ import annotations

import re
from functools import lru_cache

from ..data.tokenizers import SPECIALS

VISIBLE = {" ": "\u2423", "\n": "\u23ce", "\t": "\u21e5", "\r": "\u240d"}
CONTINUATION = "\u00b7"  # a WordPiece token that continues the previous word
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, reversed: char -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def visible(text: str) -> str:
    """Whitespace as symbols, so a space or newline token is not an empty label."""
    return "".join(VISIBLE.get(c, c) for c in text)


def readable(raw: str, *, special: bool = False, byte_level: bool = False) -> str:
    """One vocabulary string -> its label (see the module docstring)."""
    if special or not raw:
        return raw
    if raw.startswith("##") and len(raw) > 2:
        return CONTINUATION + visible(raw[2:])
    found = _BYTE_TOKEN.fullmatch(raw)
    if found:
        data = bytes([int(found.group(1), 16)])
    elif byte_level:
        decoder = _byte_decoder()
        data = bytes(decoder[c] for c in raw) if all(c in decoder for c in raw) else None
        if data is None:
            return visible(raw)
    else:
        return visible(raw.replace("\u2581", " "))
    return visible(data.decode("utf-8", errors="backslashreplace"))


def _probe_byte_level(tokenizer, lookup) -> bool:
    """Byte-level vocabularies never hold a raw space: see how the tokenizer writes " a"."""
    return any("Ġ" in s for s in lookup(tokenizer.encode(" a x")))


def token_labels(tokenizer, ids: list[int]) -> list[str]:
    """Labels for ``ids``: from the tokenizer's vocabulary strings when it exposes them
    (``token_strings``, or a Hugging Face ``tokenizers.Tokenizer`` inside), else from decoding
    each id alone; specials (``special_ids``, or ids that decode to nothing) by name."""
    ids = [int(i) for i in ids]
    specials = set(getattr(tokenizer, "special_ids", ()) or ())
    if hasattr(tokenizer, "token_strings"):
        def lookup(some):
            return list(tokenizer.token_strings(some))
    elif hasattr(getattr(tokenizer, "tokenizer", None), "id_to_token"):
        def lookup(some):
            return [tokenizer.tokenizer.id_to_token(int(i)) or "" for i in some]
    else:
        return [_decoded_label(tokenizer, i) for i in ids]
    strings = lookup(ids)
    byte_level = any(c in "ĠĊ" for i, s in zip(ids, strings, strict=True) if i not in specials
                     for c in s) or _probe_byte_level(tokenizer, lookup)
    return [readable(s, special=i in specials, byte_level=byte_level)
            for i, s in zip(ids, strings, strict=True)]


def _decoded_label(tokenizer, token_id: int) -> str:
    text = tokenizer.decode([token_id])
    if text:
        return visible(text)

    # qkv's own tokenizers reserve ids 0..3 for <pad> <bos> <eos> <unk>.
    return SPECIALS[token_id] if token_id < len(SPECIALS) else f"<unknown id {token_id}>"
