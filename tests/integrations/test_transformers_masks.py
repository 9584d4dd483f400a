"""qkv's mask function against transformers' own (sdpa_mask materializes the same
mask_function): the same allowed pairs, structured qkv masks where transformers' pieces are
recognized, and tile states that agree with the rule."""

import pytest
import torch
from transformers import masking_utils as hf

from qkv.core import masks as qm
from qkv.integrations.transformers.masks import (
    KeyMask,
    Prepared,
    Shifted,
    Unmasked,
    mask_function,
)

B = 3


def built(batch, nq, nk, *args, **kwargs):
    """The qkv mask of ``mask_function``, which returns it as a prepared (B, 1, Nq, Nk)
    BlockMask, the type transformers passes back unchanged."""
    prepared = mask_function(batch, nq, nk, *args, **kwargs)
    assert isinstance(prepared, Prepared) and prepared.shape == (batch, 1, nq, nk)
    return prepared.mask


def padding(kind: str, n: int) -> torch.Tensor:
    mask = torch.ones(B, n, dtype=torch.long)
    for b in range(B):
        if kind == "left":
            mask[b, :2 * b] = 0
        elif kind == "right":
            mask[b, n - 2 * b:] = 0
        elif kind == "holes":
            mask[b, 1 + b::3] = 0
    return mask


def packed_positions(n: int) -> torch.Tensor:
    return torch.cat([torch.arange(k) for k in (n // 3, n - n // 3)]).expand(B, -1)


def function(kind: str, n: int):
    positions = packed_positions(n)
    ids = hf.find_packed_sequence_indices(positions)
    blocks = torch.full((B, 64), -1)
    blocks[:, 2:5] = 7
    return {
        "causal": hf.causal_mask_function,
        "bidirectional": hf.bidirectional_mask_function,
        "sliding": hf.sliding_window_causal_mask_function(4),
        "sliding_bidirectional": hf.sliding_window_bidirectional_mask_function(2),
        "chunked": hf.chunked_causal_mask_function(3, torch.tensor([0, 1, 2])),
        "packed": hf.and_masks(
            hf.remap_positions_for_packed_sequence(
                hf.sliding_window_causal_mask_function(3), positions),
            hf.packed_sequence_mask_function(ids)),
        "blockwise": hf.or_masks(hf.causal_mask_function, hf.blockwise_overlay(blocks)),
        "custom": hf.or_masks(hf.causal_mask_function, lambda b, h, q, kv: kv < 2),
    }[kind]


# (Nq, Nk, q_offset, kv_offset): a forward pass, a decode step, a cache chunk, a sliding
# cache that dropped its oldest keys, and a static cache longer than what was seen.
SIZES = [(10, 10, 0, 0), (1, 10, 9, 0), (4, 10, 6, 0), (3, 6, 9, 6), (2, 12, 5, 0)]


@pytest.mark.parametrize("kind", ["causal", "bidirectional", "sliding", "sliding_bidirectional",
                                  "chunked", "packed", "blockwise", "custom"])
@pytest.mark.parametrize("pad", ["none", "left", "right", "holes"])
@pytest.mark.parametrize("sizes", SIZES)
def test_same_allowed_pairs_as_transformers(kind, pad, sizes):
    nq, nk, q_offset, kv_offset = sizes
    if kind == "packed" and sizes != SIZES[0]:
        pytest.skip("transformers packs sequences only without a cache")
    fn = function(kind, nq)
    attention_mask = None if pad == "none" else padding(pad, q_offset + nq)
    expected = hf.sdpa_mask(batch_size=B, q_length=nq, kv_length=nk, q_offset=q_offset,
                            kv_offset=kv_offset, mask_function=fn,
                            attention_mask=attention_mask, allow_is_causal_skip=False,
                            use_vmap=kind in ("custom", "blockwise", "chunked"))
    mask = built(B, nq, nk, q_offset, kv_offset, mask_function=fn,
                         attention_mask=attention_mask, allow_is_causal_skip=True,
                         dtype=torch.float32, config=None, use_vmap=False, device="cpu")
    got = mask.materialize(B, 1, nq, nk).expand(B, 1, nq, nk)
    assert torch.equal(got, expected.expand(B, 1, nq, nk))
    # Tile states: exact where they claim FULL or EMPTY (the generic classifier evaluates the rule).
    states = mask.tile_states(B, 2, nq, nk, 2, 4)
    generic = qm.Mask.tile_states(mask, B, 2, nq, nk, 2, 4)
    decided = states != qm.PARTIAL
    assert torch.equal(states.expand_as(generic)[decided.expand_as(generic)],
                       generic[decided.expand_as(generic)])


def test_structure_is_kept():
    left = padding("left", 10)
    causal_left = built(B, 10, 10, attention_mask=left)
    assert isinstance(causal_left, qm.AndMask) and isinstance(causal_left.a, qm.CausalMask)
    assert repr(causal_left) == "(causal() & ~padding([0, 2, 4]))"
    window = built(B, 10, 10, mask_function=hf.sliding_window_causal_mask_function(4))
    assert repr(window) == "sliding_window(3, 0)"
    assert repr(built(B, 10, 10, attention_mask=padding("right", 10))) == (
        "(causal() & padding([10, 8, 6]))")
    assert isinstance(built(B, 10, 10, attention_mask=padding("holes", 10)).b, KeyMask)
    assert isinstance(built(B, 10, 10, mask_function=hf.bidirectional_mask_function),
                      Unmasked)
    assert isinstance(built(B, 2, 12, 5, 0), Shifted)
    custom = built(B, 10, 10, mask_function=function("custom", 10))
    assert isinstance(custom.a, qm.CausalMask) and isinstance(custom.b, qm.CustomMask)


def test_unknown_argument_is_named():
    with pytest.raises(TypeError, match="'head_mask'"):
        built(B, 4, 4, head_mask=torch.ones(2))
