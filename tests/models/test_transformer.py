"""The encoder-decoder: parity with torch.nn.Transformer, decoding, configuration."""

import dataclasses
import json
import math

import pytest
import torch

from qkv.models import Transformer, TransformerConfig
from qkv.nn import MultiHeadAttention


def paper_sinusoid(n, d):
    """The paper's PE table written out element by element."""
    pe = torch.zeros(n, d)
    for pos in range(n):
        for i in range(0, d, 2):
            pe[pos, i] = math.sin(pos / 10000 ** (i / d))
            pe[pos, i + 1] = math.cos(pos / 10000 ** (i / d))
    return pe


def torch_reference(norm_first, batch_first):
    torch.manual_seed(0)
    m = torch.nn.Transformer(
        d_model=16, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32,
        batch_first=batch_first, norm_first=norm_first,
    ).eval()
    with torch.no_grad():  # torch zero-initializes the attention biases; make them count
        for mha in (mod for mod in m.modules() if isinstance(mod, torch.nn.MultiheadAttention)):
            mha.in_proj_bias.normal_()
            mha.out_proj.bias.normal_()
    return m, torch.nn.Embedding(23, 16), torch.nn.Embedding(19, 16), torch.nn.Linear(16, 19,
                                                                                      bias=False)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_from_torch_matches_torch_transformer(norm_first, batch_first):
    m, src_emb, tgt_emb, out = torch_reference(norm_first, batch_first)
    ours = Transformer.from_torch(m, src_emb, tgt_emb, out).eval()
    assert ours.config.block.norm_first is norm_first and ours.config.final_norm
    g = torch.Generator().manual_seed(1)
    src, tgt = torch.randint(3, 23, (3, 9), generator=g), torch.randint(3, 19, (3, 7), generator=g)
    src_lengths, tgt_lengths = torch.tensor([9, 5, 7]), torch.tensor([7, 7, 4])
    src_pad = torch.arange(9)[None] >= src_lengths[:, None]
    tgt_pad = torch.arange(7)[None] >= tgt_lengths[:, None]
    with torch.no_grad():
        s = src_emb(src) * 4 + paper_sinusoid(9, 16)
        t = tgt_emb(tgt) * 4 + paper_sinusoid(7, 16)
        if not batch_first:
            s, t = s.transpose(0, 1), t.transpose(0, 1)
        h = m(s, t, tgt_mask=m.generate_square_subsequent_mask(7), tgt_is_causal=True,
              src_key_padding_mask=src_pad, memory_key_padding_mask=src_pad,
              tgt_key_padding_mask=tgt_pad)
        ref = out(h if batch_first else h.transpose(0, 1))
        logits = ours(src, tgt, src_lengths=src_lengths, tgt_lengths=tgt_lengths)
    real = ~tgt_pad
    assert (logits[real] - ref[real]).abs().max() < 1e-5


def test_padding_from_pad_id_equals_lengths():
    model = tiny()
    src = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    tgt = torch.tensor([[1, 4, 3], [1, 4, 4]])
    with torch.no_grad():
        by_id = model(src, tgt)
        by_lengths = model(src, tgt, src_lengths=torch.tensor([3, 5]))
        alone = model(src[:1, :3], tgt[:1])
    assert torch.allclose(by_id, by_lengths) and (by_id[:1] - alone).abs().max() < 1e-5


def tiny(positions="sinusoidal", block=None, **kw):
    torch.manual_seed(0)
    return Transformer(TransformerConfig(
        src_vocab_size=20, tgt_vocab_size=20,
        block={"d_model": 16, "n_head": 4, "d_ff": 32, **(block or {})},
        positions={"kind": positions}, n_encoder_layers=2, n_decoder_layers=2, **kw
    )).eval()


@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "relative"])
def test_cached_decoding_equals_uncached(positions):
    model = tiny(positions=positions, share_embeddings=True, block={"n_kv_head": 2})
    src = torch.randint(3, 20, (2, 6), generator=torch.Generator().manual_seed(2))
    src[1, 4:] = 0
    with torch.no_grad():
        memory, keep = model.encode(src)
        tgt = torch.randint(3, 20, (2, 7), generator=torch.Generator().manual_seed(3))
        full = model.decode(tgt, memory, keep)
        cache = model.new_cache(2, 7, 6)
        steps = [model.decode(tgt[:, i:i + 1], memory, keep, cache=cache) for i in range(7)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
    greedy = model.generate(src, max_new_tokens=6)
    assert torch.equal(greedy, model.generate(src, max_new_tokens=6, use_cache=False))


def test_beam_search_decodes_and_ends_at_eos():
    model = tiny()
    with torch.no_grad():  # peaked distributions: no near-ties for rounding to flip
        model.out_proj.weight.mul_(20)
    src = torch.randint(3, 20, (3, 5), generator=torch.Generator().manual_seed(4))
    beams = model.generate(src, max_new_tokens=8, beam_size=4, length_penalty=0.6)
    assert beams.shape[0] == 3 and beams.shape[1] <= 8
    assert torch.equal(beams, model.generate(src, max_new_tokens=8, beam_size=4,
                                             length_penalty=0.6, use_cache=False))
    first = int(model.generate(src, max_new_tokens=1)[0, 0])
    out = model.generate(src, max_new_tokens=8, eos_id=first)
    assert out[0, 0] == first and (out[0, 1:] == model.config.pad_id).all()
    assert torch.equal(model.generate(src, max_new_tokens=5, beam_size=1),
                       model.generate(src, max_new_tokens=5))


def test_base_defaults_and_layers():
    c = TransformerConfig(src_vocab_size=100, tgt_vocab_size=100)
    b = c.block
    assert (b.d_model, b.n_head, c.n_encoder_layers, c.n_decoder_layers, b.d_ff, b.dropout) == (
        512, 8, 6, 6, 2048, 0.1)
    assert (b.norm_first, c.positions.kind, b.ffn, c.scale_embeddings, c.tie_output) == (
        False, "sinusoidal", "relu", True, True)
    model = tiny(share_embeddings=True)
    assert model.out_proj.weight is model.tgt_emb.weight is model.src_emb.weight
    layers = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    assert sum(m.is_cross for m in layers) == 2 and len(layers) == 6
    assert TransformerConfig(**json.loads(json.dumps(dataclasses.asdict(model.config)))) == (
        model.config)


def test_similarity_choices_and_bad_config():
    for similarity in ("cosine", "l1"):
        model = tiny(block={"similarity": similarity})
        src, tgt = torch.randint(3, 20, (2, 5)), torch.randint(3, 20, (2, 4))
        assert model(src, tgt).shape == (2, 4, 20)
    with pytest.raises(ValueError, match="share_embeddings"):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=12, share_embeddings=True)
    with pytest.raises(ValueError, match="divisible by n_head"):
        TransformerConfig(src_vocab_size=10, tgt_vocab_size=10,
                          block={"d_model": 30, "n_head": 4})
    with pytest.raises(ValueError, match="max_len=4"):
        tiny(positions="learned", max_len=4)(torch.ones(1, 5, dtype=torch.long),
                                             torch.ones(1, 2, dtype=torch.long))
