"""What transformers' own tests expect of an attention function, which SDPA and eager meet:
extra keyword arguments ignored, flash-attention's packed-row lengths honoured, a mask built
ahead (static-cache generation) taken back, additive float 4-D masks, and attention weights
on the output's graph (with sinks too)."""

import pytest
import torch
import transformers as tf

from qkv.integrations.transformers import attention_forward

from .conftest import left_padded, tiny_bert
from .test_transformers_models import build


def logits(model, implementation, **inputs):
    model.set_attn_implementation(implementation)
    return model(**inputs).logits


def test_a_forwards_loss_keywords_reach_attention_and_are_ignored():
    model = build("llama")
    ids, mask = left_padded()
    labels = ids.masked_fill(mask == 0, -100)
    shift = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    out = {}
    for implementation in ("sdpa", "qkv"):
        model.set_attn_implementation(implementation)
        out[implementation] = model(input_ids=ids, attention_mask=mask, labels=labels,
                                    shift_labels=shift)
    assert (out["qkv"].logits - out["sdpa"].logits)[mask.bool()].abs().max() <= 1e-5
    assert abs(out["qkv"].loss.item() - out["sdpa"].loss.item()) <= 1e-5


def test_flattened_batches_stay_within_their_sequences():
    """DataCollatorWithFlattening's cu_seq_lens_q/k give the segments: with position ids that
    do not restart (so that only the lengths can separate them) attention still stays in each
    sequence, as flash-attention's varlen kernels keep it."""
    module = torch.nn.Module()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, _ = attention_forward(module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                               max_length_q=5, max_length_k=5)
    docs = torch.tensor([0] * 4 + [1] * 5)
    allowed = (docs[:, None] == docs[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))
    assert (out - (scores.softmax(-1) @ v).transpose(1, 2)).abs().max() <= 1e-6
    with pytest.raises(ValueError, match="cu_seq_lens_q must run from 0 to the packed row's "
                                         "length 9"):
        attention_forward(module, q, k, v, None, cu_seq_lens_q=torch.tensor([0, 4, 8]))

    model = build("llama")
    model.set_attn_implementation("qkv")
    gen = torch.Generator().manual_seed(1)
    features = [{"input_ids": torch.randint(1, 50, (n,), generator=gen).tolist()}
                for n in (5, 7)]
    batch = tf.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)
    assert "cu_seq_lens_q" in batch
    batch.pop("labels")
    packed = model(**batch).logits[0]
    alone = torch.cat([model(input_ids=torch.tensor([f["input_ids"]])).logits[0]
                       for f in features])
    assert (packed - alone).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_static_cache_generation_matches_eager(name):
    model = build(name)
    ids, mask = left_padded(n=8)
    outputs = {}
    for implementation in ("eager", "qkv"):
        model.set_attn_implementation(implementation)
        outputs[implementation] = model.generate(
            ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
            cache_implementation="static")
    assert torch.equal(outputs["qkv"], outputs["eager"])


def test_custom_4d_float_mask_matches_sdpa():
    """transformers' test_custom_4d_attention_mask: three sequences sharing a prefix, packed
    in one row, as a 4-D additive mask of 0 and the dtype's minimum."""
    model = build("llama")
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    # Rows 0-2 a prefix; 3-4 continue it; 5-6 continue it otherwise.
    allowed = torch.zeros(7, 7, dtype=torch.bool)
    for row, keys in enumerate([[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4],
                                [0, 1, 2, 5], [0, 1, 2, 5, 6]]):
        allowed[row, keys] = True
    float_mask = torch.zeros(1, 1, 7, 7).masked_fill(~allowed, torch.finfo(torch.float32).min)
    positions = torch.tensor([[0, 1, 2, 3, 4, 3, 4]])
    ref = logits(model, "sdpa", input_ids=ids, attention_mask=float_mask, position_ids=positions)
    out = logits(model, "qkv", input_ids=ids, attention_mask=float_mask, position_ids=positions)
    assert (out - ref).abs().max() <= 1e-5
    # The same as two separate sequences.
    alone = logits(model, "qkv", input_ids=ids[:, [0, 1, 2, 5, 6]])
    assert (out[:, [5, 6]] - alone[:, [3, 4]]).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["gpt_oss", "llama"])
def test_attention_weights_get_the_gradient_eager_gives_them(name):
    """transformers' test_retain_grad_hidden_states_attentions, and the values: the returned
    weights are the ones that multiplied v, so the loss's gradient reaches them."""
    model = build(name)
    ids, _ = left_padded(batch=1)
    grads = {}
    for implementation in ("eager", "qkv"):
        model.set_attn_implementation(implementation)
        out = model(input_ids=ids, output_attentions=True)
        weights = out.attentions[0]
        weights.retain_grad()
        out.logits.square().sum().backward()
        assert weights.grad is not None, implementation
        grads[implementation] = weights.grad
    assert (grads["qkv"] - grads["eager"]).abs().max() <= 1e-4 * grads["eager"].abs().max()


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_a_causal_or_bidirectional_forward_compiles_without_graph_breaks(name):
    """transformers' test_generate_compile_model_forward_fullgraph: the mask is traced with
    the model (a window's or packed documents' parameters live in closures torch.compile
    cannot read, so those compositions are still built eagerly: docs/transformers.md)."""
    model = tiny_bert() if name == "bert" else build(name)
    ids, mask = left_padded(n=8)
    model.set_attn_implementation("qkv")
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = compiled(input_ids=ids, attention_mask=mask)
    ref = model(input_ids=ids, attention_mask=mask)
    key = "last_hidden_state" if name == "bert" else "logits"
    assert (out[key] - ref[key])[mask.bool()].abs().max() <= 1e-5


def test_static_cache_compiled_generation_compiles_once():
    """transformers' test_static_cache_no_recompile_with_smaller_length: the decoding forward,
    compiled with fullgraph, takes every step and a second, shorter prompt without
    recompiling (a static cache's offsets reach the mask as tensors)."""
    model = build("llama")
    model.set_attn_implementation("qkv")
    config = tf.CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True  # generate compiles on GPUs only unless told
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    prompts = [torch.randint(1, 50, (1, n), generator=torch.Generator().manual_seed(n))
               for n in (10, 6)]
    outputs = [model.generate(p, max_new_tokens=5, do_sample=False, pad_token_id=0,
                              cache_implementation="static", compile_config=config)
               for p in prompts]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    model.set_attn_implementation("eager")
    for prompt, out in zip(prompts, outputs, strict=True):
        ref = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0,
                             disable_compile=True)
        assert torch.equal(out, ref)
