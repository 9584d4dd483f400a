"""The real checkpoints in transformers on qkv against transformers' SDPA: all-MiniLM-L6-v2
(BertModel) and SmolLM2-135M-Instruct (LlamaForCausalLM from the shipped GGUF)."""

import pytest
import torch

from qkv.models.pretrained import resolve

from .. import hf_smollm2

SENTENCES = ["Attention is all you need.", "The quick brown fox jumps over the lazy dog, twice.",
             "qkv"]


def outputs(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    with torch.no_grad():
        return model(**inputs)


@pytest.mark.slow
def test_minilm_hidden_states_match_sdpa():
    from transformers import AutoTokenizer, BertModel

    path = resolve("minilm")
    model = BertModel.from_pretrained(path, dtype=torch.float32).eval()
    batch = AutoTokenizer.from_pretrained(path)(SENTENCES, padding=True, return_tensors="pt")
    ref = outputs(model, "sdpa", **batch).last_hidden_state
    got = outputs(model, "qkv", **batch).last_hidden_state
    real = batch["attention_mask"].bool()
    assert (got - ref)[real].abs().max() <= 1e-5


@pytest.mark.slow
def test_smollm2_logits_and_greedy_generation_match_sdpa():
    model, tokenizer = hf_smollm2.hf_model(), hf_smollm2.hf_tokenizer()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    real = batch["attention_mask"].bool()
    ref = outputs(model, "sdpa", **batch).logits
    got = outputs(model, "qkv", **batch).logits
    assert (got - ref)[real].abs().max() <= 1e-5 * max(1.0, ref[real].abs().max().item())
    generated = {}
    for implementation in ("sdpa", "qkv"):
        model.set_attn_implementation(implementation)
        generated[implementation] = model.generate(
            **batch, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert torch.equal(generated["qkv"], generated["sdpa"])
