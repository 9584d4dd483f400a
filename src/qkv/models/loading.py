"""``load_pretrained``: a checkpoint's model (a GPT or an Encoder) with its tokenizer."""

from __future__ import annotations

from .encoder import Encoder
from .gpt import GPT
from .pretrained import has_tokenizer, is_encoder, load_tokenizer, resolve


def load_pretrained(name_or_path):
    """(model, tokenizer) of a checkpoint (a directory, a ``.gguf`` file, or a short name
    such as ``smollm2`` or ``minilm``): a GPT for decoders, an Encoder for BERT. The
    tokenizer is None when a directory holds none."""
    path = resolve(name_or_path)
    model = Encoder.from_pretrained(path) if is_encoder(path) else GPT.from_pretrained(path)
    return model, (load_tokenizer(path) if has_tokenizer(path) else None)
