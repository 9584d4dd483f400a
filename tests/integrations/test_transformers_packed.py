"""transformers' test_*_padding_matches_padding_free_with_position_ids, in fp32 and tightly:
documents packed in one row, told apart only by position ids that restart at 0, equal each
document run alone and the left-padded batch, with windows shorter than the documents and
GPT-OSS's sinks. GPT-OSS does not hand its position ids to transformers' mask creation, so
only the attention function sees them."""

import pytest
import torch
from transformers import masking_utils as hf

from qkv.integrations.transformers import attention_forward, mask_function
from qkv.integrations.transformers.masks import Prepared

from .test_transformers_models import build

LENGTHS = (5, 7, 3)


def documents():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(1, 50, (n,), generator=gen) for n in LENGTHS]


def packed_row(docs):
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    return ids, positions


def left_padded_batch(docs):
    n = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, doc in enumerate(docs):
        ids[row, n - len(doc):] = doc
        mask[row, n - len(doc):] = 1
    return ids, mask


@pytest.mark.parametrize("name", ["gpt_oss", "mistral", "llama"])
def test_a_packed_row_equals_its_documents_alone_and_padded(name):
    model = build(name)
    model.set_attn_implementation("qkv")
    docs = documents()
    ids, positions = packed_row(docs)
    packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=d[None], use_cache=False).logits[0] for d in docs])
        padded_ids, padded_mask = left_padded_batch(docs)
        padded = model(input_ids=padded_ids, attention_mask=padded_mask,
                       use_cache=False).logits[padded_mask.bool()]
    assert (packed - alone).abs().max() <= 1e-5
    assert (packed - padded).abs().max() <= 1e-5

    # Training on the packed row: every gradient as with the documents one by one.
    packed.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    for doc in docs:
        model(input_ids=doc[None], use_cache=False).logits.square().sum().backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            assert (grads[n] - p.grad).abs().max() <= 1e-4 * max(1.0, p.grad.abs().max()), n


def attention(mask, positions, q, k, v):
    out, _ = attention_forward(torch.nn.Module(), q, k, v, mask, position_ids=positions)
    return out


def test_position_ids_that_restart_keep_the_attention_function_within_each_run():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 9, 8, generator=g) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])
    docs = torch.tensor([0] * 4 + [1] * 5)
    allowed = (docs[:, None] == docs[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()
    scores = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))
    expected = (scores.softmax(-1) @ v).transpose(1, 2)
    causal = mask_function(1, 9, 9)  # what a model that keeps its position ids builds
    assert isinstance(causal, Prepared) and not causal.packed
    assert (attention(causal, positions, q, k, v) - expected).abs().max() <= 1e-6
    assert (attention(None, positions, q, k, v) - expected).abs().max() <= 1e-6

    # Positions that never restart: one document, nothing to separate.
    whole = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(
        ~torch.ones(9, 9, dtype=torch.bool).tril(), float("-inf"))
    assert (attention(causal, torch.arange(9)[None], q, k, v)
            - (whole.softmax(-1) @ v).transpose(1, 2)).abs().max() <= 1e-6
    # A 4-D tensor mask is the caller's whole layout (transformers' custom 4-D mask test
    # restarts its positions for a shared prefix).
    layout = torch.ones(1, 1, 9, 9, dtype=torch.bool).tril()
    assert (attention(layout, positions, q, k, v)
            - (whole.softmax(-1) @ v).transpose(1, 2)).abs().max() <= 1e-6


def test_a_mask_transformers_built_from_the_position_ids_is_marked_packed():
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    ids = hf.find_packed_sequence_indices(positions)
    fn = hf.and_masks(hf.remap_positions_for_packed_sequence(hf.causal_mask_function, positions),
                      hf.packed_sequence_mask_function(ids))
    assert mask_function(1, 7, 7, mask_function=fn).packed
