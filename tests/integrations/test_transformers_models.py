"""Tiny random transformers models on attn_implementation="qkv" against their own eager
attention, same weights, fp32, left-padded batches: logits, every parameter gradient and
output_attentions."""

import copy

import pytest
import torch
import transformers as tf

from .conftest import assert_matches_eager, left_padded, tiny, tiny_bert

CASES = {
    "llama": (tf.LlamaForCausalLM, tiny(tf.LlamaConfig)),
    "mistral": (tf.MistralForCausalLM, tiny(tf.MistralConfig, sliding_window=4)),
    "qwen3": (tf.Qwen3ForCausalLM, tiny(
        tf.Qwen3Config, use_sliding_window=True, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"])),
    # A small softcap so that tanh bends the scores; one sliding and one global layer.
    "gemma2": (tf.Gemma2ForCausalLM, tiny(
        tf.Gemma2Config, sliding_window=4, attn_logit_softcapping=0.5,
        final_logit_softcapping=None, query_pre_attn_scalar=8)),
    "gpt_oss": (tf.GptOssForCausalLM, tiny(
        tf.GptOssConfig, sliding_window=4, num_local_experts=2, num_experts_per_tok=1,
        layer_types=["sliding_attention", "full_attention"])),
}


def build(name, **overrides):
    """The tiny model ``name`` with its random weights, its config's fields changed by
    ``overrides`` (on a copy: the cases stay as they are)."""
    model_cls, config = CASES[name]
    if overrides:
        config = copy.deepcopy(config)
        for field, value in overrides.items():
            setattr(config, field, value)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    for module in model.modules():  # sinks start at zero: make them matter
        if hasattr(module, "sinks"):
            torch.nn.init.normal_(module.sinks, std=1.0)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_causal_lm_matches_eager_on_a_left_padded_batch(name):
    ids, mask = left_padded()
    assert_matches_eager(build(name), ids, mask)


def test_bert_matches_eager_with_left_and_right_padding():
    torch.manual_seed(0)
    model = tiny_bert()
    ids, mask = left_padded()
    assert_matches_eager(model, ids, mask, labels=False)
    assert_matches_eager(model, ids, mask.flip(1), labels=False)


def test_greedy_generation_with_the_cache_matches_eager():
    model = build("gemma2")
    ids, mask = left_padded(n=8)
    outputs = {}
    for implementation in ("eager", "qkv"):
        model.set_attn_implementation(implementation)
        outputs[implementation] = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(outputs["qkv"], outputs["eager"])


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_packed_sequences_match_separate_sequences(name):
    """Position ids that restart mark packed documents (transformers packs only without a
    cache): attention stays inside each one, and a window restarts with it."""
    model = build(name)
    model.set_attn_implementation("qkv")
    gen = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 50, (n,), generator=gen) for n in (5, 7)]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    packed = model(input_ids=torch.cat(docs)[None], position_ids=positions,
                   use_cache=False).logits[0]
    alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
    assert (packed - alone).abs().max() <= 1e-5


def test_dropout_applies_in_training_only():
    model = build("llama")
    model.config.attention_dropout = 0.5
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    model.set_attn_implementation("qkv")
    ids, mask = left_padded()
    model.eval()
    first, second = (model(input_ids=ids, attention_mask=mask).logits for _ in range(2))
    assert torch.equal(first, second)
    model.train()
    first, second = (model(input_ids=ids, attention_mask=mask).logits for _ in range(2))
    assert not torch.allclose(first, second)
