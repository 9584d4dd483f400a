"""Tiny TransformerLens bridges built offline: transformers models from small configs and a
word-level tokenizer, so nothing is fetched from a model hub."""

from __future__ import annotations

import copy

import torch


def tokenizer(vocab_size: int = 50, words: tuple[str, ...] = ()):
    """A whitespace word-level ``PreTrainedTokenizerFast``: <unk>, <s>, </s>, then ``words``,
    then w0, w1, ... up to ``vocab_size`` ids. It adds <s> in front (TransformerLens asks for
    a tokenizer that prepends BOS and would otherwise reload it from the hub by name)."""
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    names = ["<unk>", "<s>", "</s>", *words]
    names += [f"w{i}" for i in range(vocab_size - len(names))]
    inner = Tokenizer(models.WordLevel({w: i for i, w in enumerate(names)}, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=inner, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="</s>", add_bos_token=True, name_or_path="tiny-word-level")


def llama(layers: int = 2, seed: int = 0, **overrides):
    """A LlamaForCausalLM in eval mode: 4 query heads over 2 key/value heads, head dim 8."""
    import transformers as tf

    torch.manual_seed(seed)
    fields = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, pad_token_id=2)
    fields.update(overrides)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**fields)).eval()


def gpt2(layers: int = 3, seed: int = 0, words: tuple[str, ...] = ()):
    """A GPT2LMHeadModel in eval mode (4 heads of 8), over ``tokenizer(words=words)``."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.GPT2Config(vocab_size=50, n_embd=32, n_layer=layers, n_head=4, n_positions=64,
                           bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return tf.GPT2LMHeadModel(config).eval()


def bridge(model, name: str = "tiny", words: tuple[str, ...] = ()):
    """A ``TransformerBridge`` over a copy of ``model`` (eager attention, TransformerLens's
    default), so that several bridges over one model's weights stay independent."""
    from transformer_lens.model_bridge import TransformerBridge

    return TransformerBridge.boot_transformers(
        name, hf_model=copy.deepcopy(model), device="cpu",
        tokenizer=tokenizer(model.config.vocab_size, words))
