"""A registered variant (L1 similarity) on a pretrained-style model against a materialized L1
reference, torch.compile of models on qkv, and the errors that name what qkv cannot honour."""

import math

import pytest
import torch
import transformers as tf
from transformers.masking_utils import AttentionMaskInterface, eager_mask

from qkv.integrations.transformers import attention_forward, register

from .conftest import assert_matches_eager, left_padded, run, tiny, tiny_bert


def l1_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                 **kwargs):
    """-scaling·‖q - k‖₁ materialized, plus eager's additive mask, softmax, times v."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = -scaling * (query[..., :, None, :] - key[..., None, :, :]).abs().sum(-1)
    weights = torch.softmax(scores + attention_mask, dim=-1)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def assert_registered_variant_matches(reference, **variant):
    """A tiny left-padded Llama with qkv registered under ``variant`` against the same model
    on the materialized ``reference`` attention: logits within 1e-5 on real tokens and every
    gradient within 1e-4. Returns the model, its inputs and the variant's logits."""
    name = reference.__name__
    tf.AttentionInterface.register(name, reference)
    AttentionMaskInterface.register(name, eager_mask)
    assert register(f"qkv_{name}", **variant) == f"qkv_{name}"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tiny(tf.LlamaConfig)).eval()
    ids, mask = left_padded()
    ref_logits, ref_grads, _ = run(model, name, ids, mask)
    logits, grads, _ = run(model, f"qkv_{name}", ids, mask)
    assert (logits - ref_logits)[mask.bool()].abs().max() <= 1e-5
    assert max((grads[n] - ref_grads[n]).abs().max() for n in grads) <= 1e-4
    return model, ids, mask, logits


def test_l1_variant_matches_a_materialized_l1_reference():
    model, ids, mask, logits = assert_registered_variant_matches(l1_reference, similarity="l1")
    eager, _, _ = run(model, "eager", ids, mask)
    assert (logits - eager)[mask.bool()].abs().max() > 1e-3  # the variant does change the model


def sigmoid_reference(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """σ(scaling·q·k - log Nk) materialized; eager's additive mask (-inf) gives σ = 0."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = scaling * query @ key.transpose(-1, -2) + attention_mask - math.log(key.shape[2])
    weights = torch.sigmoid(scores)
    return (weights @ value).transpose(1, 2).contiguous(), weights


def test_a_registered_weighting_matches_a_materialized_sigmoid_reference():
    assert_registered_variant_matches(sigmoid_reference, weighting="sigmoid")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_compiled_model_matches_eager(name):
    torch._dynamo.reset()
    if name == "llama":
        model = tf.LlamaForCausalLM(tiny(tf.LlamaConfig))
    else:
        model = tf.Gemma2ForCausalLM(tiny(tf.Gemma2Config, sliding_window=4,
                                          attn_logit_softcapping=0.5, query_pre_attn_scalar=8))
    model.eval()
    ids, mask = left_padded()
    ref, _, _ = run(model, "eager", ids, mask)
    model.set_attn_implementation("qkv")
    compiled = torch.compile(model, backend="aot_eager")
    logits = compiled(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logits[mask.bool()].sum().backward()
    assert (logits.detach() - ref)[mask.bool()].abs().max() <= 1e-5
    assert all(p.grad is not None for p in model.model.layers[0].self_attn.parameters())


@pytest.mark.slow
def test_compiled_bert_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tiny_bert()
    ids, mask = left_padded()
    ref = model(input_ids=ids, attention_mask=mask.flip(1)).last_hidden_state
    model.set_attn_implementation("qkv")
    out = torch.compile(model, backend="aot_eager")(input_ids=ids, attention_mask=mask.flip(1))
    assert (out.last_hidden_state - ref)[mask.flip(1).bool()].abs().max() <= 1e-5


def test_what_qkv_cannot_honour_is_named():
    q = k = v = torch.randn(1, 2, 4, 8)
    module = torch.nn.Module()
    with pytest.raises(TypeError, match="'position_bias'"):
        attention_forward(module, q, k, v, None, position_bias=torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match="head_mask"):
        attention_forward(module, q, k, v, None, head_mask=torch.ones(2))
    with pytest.raises(TypeError, match="attention_mask must be a bool or float tensor"):
        attention_forward(module, q, k, v, torch.zeros(1, 1, 4, 4, dtype=torch.long))
    with pytest.raises(TypeError, match="'dropout_p'"):
        register("bad", dropout_p=0.1)


def test_unmasked_bidirectional_and_bool_masks():
    q, k, v = (torch.randn(2, 2, 5, 8) for _ in range(3))
    module = torch.nn.Module()
    module.is_causal = False
    full, _ = attention_forward(module, q, k, v, None)
    ref = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    assert (full - ref.transpose(1, 2)).abs().max() <= 1e-5
    allowed = torch.rand(2, 1, 5, 5) > 0.3
    allowed[..., 0] = True
    masked, weights = attention_forward(module, q, k, v, allowed, output_attentions=True)
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))
    assert (weights - torch.softmax(scores, -1)).abs().max() <= 1e-5
    assert (masked - (torch.softmax(scores, -1) @ v).transpose(1, 2)).abs().max() <= 1e-5


def test_assert_matches_eager_reports_errors():
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(tiny(tf.Qwen3Config)).eval()
    errors = assert_matches_eager(model, *left_padded())
    assert all(e <= 1e-4 for e in errors)
