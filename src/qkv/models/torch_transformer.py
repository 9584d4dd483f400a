"""Convert a torch.nn.Transformer (plus embeddings and output layer) into a qkv Transformer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..nn.attention import MultiHeadAttention


def _activation(layer: nn.Module) -> str:
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or isinstance(act, nn.GELU):
        return "gelu"
    raise ValueError(f"from_torch: activation {act!r} is not supported (relu or gelu)")


def _copy(dst: nn.Module, src: nn.Module) -> None:
    dst.load_state_dict(src.state_dict())


def transformer_from_torch(cls, config_cls, m, src_embedding, tgt_embedding, output,
                           **overrides):
    """``cls(config_cls(...))`` (a qkv Transformer and its config class, passed in so that
    this module does not import the model's) with ``m``'s weights copied in."""
    if not isinstance(m, nn.Transformer):
        raise TypeError(f"from_torch expects torch.nn.Transformer; got {type(m).__name__}")
    if not isinstance(src_embedding, nn.Embedding):
        raise TypeError("from_torch: src_embedding must be an nn.Embedding")
    if not isinstance(m.encoder, nn.TransformerEncoder) or not isinstance(
        m.decoder, nn.TransformerDecoder
    ):
        raise ValueError("from_torch: custom_encoder / custom_decoder are not supported")
    enc0 = m.encoder.layers[0]
    tgt = src_embedding if tgt_embedding is None else tgt_embedding
    if (m.encoder.norm is None) != (m.decoder.norm is None):
        raise ValueError("from_torch: the encoder and decoder must both have, or both lack, a "
                         "final norm")
    block = dict(
        d_model=enc0.self_attn.embed_dim, n_head=enc0.self_attn.num_heads,
        d_ff=enc0.linear1.out_features, dropout=enc0.dropout.p, norm_first=enc0.norm_first,
        ffn=_activation(enc0), norm="layernorm", norm_eps=enc0.norm1.eps,
        bias=enc0.linear1.bias is not None,
    )
    settings = dict(
        src_vocab_size=src_embedding.num_embeddings, tgt_vocab_size=tgt.num_embeddings,
        n_encoder_layers=len(m.encoder.layers), n_decoder_layers=len(m.decoder.layers),
        final_norm=m.encoder.norm is not None, share_embeddings=tgt is src_embedding,
        tie_output=output is None,
    )
    # Keywords of the config (max_len, positions={"kind": ...}, ...); a block dict adds to
    # what the torch model decides.
    block.update(overrides.pop("block", {}))
    settings.update(overrides)
    model = cls(config_cls(**settings, block=block))
    with torch.no_grad():
        model.src_emb.weight.copy_(src_embedding.weight)
        model.tgt_emb.weight.copy_(tgt.weight)
        if output is not None:
            if output.bias is not None:
                raise ValueError("from_torch: an output layer with a bias is not supported")
            model.out_proj.weight.copy_(output.weight)
    for ours, theirs in zip(model.encoder, m.encoder.layers, strict=True):
        _copy(ours.self_attn, MultiHeadAttention.from_torch(theirs.self_attn))
        _copy(ours.ffn.up_proj, theirs.linear1)
        _copy(ours.ffn.down_proj, theirs.linear2)
        _copy(ours.attn_sublayer.norm, theirs.norm1)
        _copy(ours.ffn_sublayer.norm, theirs.norm2)
    for ours, theirs in zip(model.decoder, m.decoder.layers, strict=True):
        _copy(ours.self_attn, MultiHeadAttention.from_torch(theirs.self_attn))
        _copy(ours.cross_attn, MultiHeadAttention.from_torch(theirs.multihead_attn))
        _copy(ours.ffn.up_proj, theirs.linear1)
        _copy(ours.ffn.down_proj, theirs.linear2)
        _copy(ours.attn_sublayer.norm, theirs.norm1)
        _copy(ours.cross_sublayer.norm, theirs.norm2)
        _copy(ours.ffn_sublayer.norm, theirs.norm3)
    if m.encoder.norm is not None:
        _copy(model.encoder_norm, m.encoder.norm)
        _copy(model.decoder_norm, m.decoder.norm)
    return model
