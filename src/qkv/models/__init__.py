"""The four model families: the encoder-decoder Transformer, GPT, Encoder and ViT."""

from .encoder import Encoder, EncoderConfig
from .generation import ModelCache, beam_search, choose_next, filter_logits, sample
from .gpt import GPT, GPTConfig
from .pretrained import load_pretrained, load_tokenizer
from .transformer import Transformer, TransformerConfig
from .vit import ViT, ViTConfig

__all__ = [
    "GPT", "Encoder", "EncoderConfig", "GPTConfig", "ModelCache", "Transformer",
    "TransformerConfig", "ViT", "ViTConfig", "beam_search", "choose_next", "filter_logits",
    "load_pretrained", "load_tokenizer", "sample",
]
