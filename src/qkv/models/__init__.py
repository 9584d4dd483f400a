"""The four model families: the encoder-decoder Transformer, GPT, Encoder and ViT."""

from .configs import EncoderConfig, GPTConfig, TransformerConfig, ViTConfig
from .encoder import Encoder
from .generation import ModelCache, beam_search, choose_next, filter_logits, sample
from .gpt import GPT
from .loading import load_pretrained
from .pretrained import load_tokenizer
from .transformer import Transformer
from .vit import ViT

__all__ = [
    "GPT", "Encoder", "EncoderConfig", "GPTConfig", "ModelCache", "Transformer",
    "TransformerConfig", "ViT", "ViTConfig", "beam_search", "choose_next", "filter_logits",
    "load_pretrained", "load_tokenizer", "sample",
]
