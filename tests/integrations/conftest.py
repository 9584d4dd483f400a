"""Shared pieces for the transformers integration tests: offline Hugging Face, qkv registered,
tiny random models built from configs, and the comparison against the model's eager attention."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("transformers")

from qkv.integrations.transformers import register  # noqa: E402

register()


def tiny(config_cls, **overrides):
    """A small config: 2 layers, 4 query heads over 2 key/value heads, head dim 8."""
    fields = dict(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=128, attn_implementation="eager")
    fields.update(overrides)
    return config_cls(**fields)


def left_padded(batch=3, n=12, vocab=50, seed=0):
    """input_ids (B, N) and a left-padded attention_mask: row b starts after 3·b pad tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, n), generator=gen)
    mask = torch.ones(batch, n, dtype=torch.long)
    for b in range(batch):
        mask[b, :3 * b] = 0
    return ids, mask


def run(model, implementation, ids, mask, labels=True):
    """Logits (B, N, V), every parameter's gradient of the loss over real tokens, and each
    layer's attention weights, under ``implementation``."""
    model.set_attn_implementation(implementation)
    model.zero_grad(set_to_none=True)
    # Labels shift by one inside the model: a pad row's logits would predict the first real
    # token, so that label is dropped too (pad rows see no key; eager averages them, qkv zeros).
    seen = torch.nn.functional.pad(mask[:, :-1], (1, 0), value=1)
    kwargs = {"labels": ids.masked_fill((mask == 0) | (seen == 0), -100)} if labels else {}
    out = model(input_ids=ids, attention_mask=mask, output_attentions=True, **kwargs)
    loss = out.loss if labels else (out.last_hidden_state * mask[..., None]).square().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    logits = out.logits if labels else out.last_hidden_state
    return logits.detach(), grads, [a.detach() for a in out.attentions]


def assert_matches_eager(model, ids, mask, implementation="qkv", labels=True):
    """Logits within 1e-5, gradients within 1e-4 and weights within 1e-5 of eager, on the real
    (unpadded) query positions; returns the largest errors for the report."""
    ref_logits, ref_grads, ref_maps = run(model, "eager", ids, mask, labels)
    logits, grads, maps = run(model, implementation, ids, mask, labels)
    real = mask.bool()
    logit_err = (logits - ref_logits)[real].abs().max().item()
    assert logit_err <= 1e-5, logit_err
    assert grads.keys() == ref_grads.keys()
    grad_err = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
    assert grad_err <= 1e-4, grad_err
    assert len(maps) == len(ref_maps) == model.config.num_hidden_layers
    # Padded query rows see no key: eager averages every key there, qkv gives zeros.
    map_err = max((m - r).permute(0, 2, 1, 3)[real].abs().max().item()
                  for m, r in zip(maps, ref_maps, strict=True))
    assert map_err <= 1e-5, map_err
    return logit_err, grad_err, map_err


def tiny_bert():
    """A 2-layer, 4-head BertModel in eval mode, eager attention, without a pooler."""
    import transformers as tf

    config = tf.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=48,
                           max_position_embeddings=64, attn_implementation="eager")
    return tf.BertModel(config, add_pooling_layer=False).eval()
