"""The four model families: the encoder-decoder Transformer, GPT, Encoder and ViT."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
