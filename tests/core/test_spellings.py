"""SDPA's and FlexAttention's call patterns run through ``qkv.attention`` unchanged, and give
their outputs and gradients: the masks, scales, GQA, unbatched inputs and dtypes of
``scaled_dot_product_attention``'s documented examples, and FlexAttention's
``create_block_mask`` document mask. Other APIs' keywords get one line naming qkv's form."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

import qkv
from qkv import engines
from qkv.core.problem import build_problem
from qkv.engines.api import _spelled_mask

from .conftest import rel_err

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")]

L, S, E = 12, 20, 8  # SDPA's names: target length, source length, embedding


def sdpa_inputs(b=2, h=4, hkv=4, nq=L, nk=S, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, E, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hkv, nk, E, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hkv, nk, E, generator=g, dtype=torch.float64).to(dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def both(call_kwargs, *, inputs, extra_grads=()):
    """(qkv's, SDPA's) outputs and gradients of one call written in SDPA's spelling."""
    results = []
    for fn in (qkv.attention, F.scaled_dot_product_attention):
        out = fn(*inputs, **call_kwargs)
        grads = torch.autograd.grad(out.double().square().sum(), [*inputs, *extra_grads])
        results.append((out, grads))
    return results


def bool_tril(nq, nk, diagonal=0):
    return torch.ones(nq, nk, dtype=torch.bool).tril(diagonal)


def additive(allowed):
    return torch.zeros(allowed.shape, dtype=torch.float64).masked_fill(~allowed, float("-inf"))


SDPA_CASES = {
    "plain": {},
    "is_causal (top-left, L < S)": {"is_causal": True},
    "bool attn_mask (L, S)": {"attn_mask": bool_tril(L, S, 3)},
    "bool attn_mask (B, 1, L, S)": {"attn_mask": torch.rand(2, 1, L, S,
                                                            generator=torch.Generator()
                                                            .manual_seed(3)) > 0.3},
    "float attn_mask (L, S)": {"attn_mask": torch.randn(L, S, generator=torch.Generator()
                                                        .manual_seed(4), dtype=torch.float64)},
    "0/-inf attn_mask, causal triangle": {"attn_mask": additive(bool_tril(L, S, S - L))},
    "0/-inf attn_mask, top-left triangle": {"attn_mask": additive(bool_tril(L, S))},
    "scale": {"scale": 0.3},
    "is_causal and scale": {"is_causal": True, "scale": 1.7},
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_call_patterns_give_sdpas_outputs_and_gradients(case):
    inputs = sdpa_inputs()
    (out, grads), (ref, ref_grads) = both(SDPA_CASES[case], inputs=inputs)
    assert rel_err(out, ref) < 1e-12, case
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < 1e-12, case


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2),
                                       (torch.float16, 3e-3)])
def test_sdpa_dtypes_with_a_float_mask(dtype, tol):
    inputs = sdpa_inputs(dtype=dtype)
    bias = torch.randn(L, S, generator=torch.Generator().manual_seed(5)).to(dtype)
    (out, grads), (ref, ref_grads) = both({"attn_mask": bias}, inputs=inputs)
    assert out.dtype == dtype
    assert rel_err(out, ref) < tol
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel_err(g, r) < tol


def test_gqa_example_with_enable_gqa():
    inputs = sdpa_inputs(h=8, hkv=2)
    (out, grads), (ref, ref_grads) = both({"enable_gqa": True, "is_causal": True},
                                          inputs=inputs)
    assert rel_err(out, ref) < 1e-12
    assert all(rel_err(g, r) < 1e-12 for g, r in zip(grads, ref_grads, strict=True))
    with pytest.raises(ValueError, match="enable_gqa=False, but q has H=8 heads and k, v "
                                         "Hkv=2"):
        qkv.attention(*inputs, enable_gqa=False)


def test_positional_arguments_in_sdpas_order():
    q, k, v = sdpa_inputs()
    mask = bool_tril(L, S, 2)
    out = qkv.attention(q, k, v, mask, 0.0, False, scale=0.5)
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v, mask, 0.0, False,
                                                       scale=0.5)) < 1e-12


def test_unbatched_inputs_and_their_weights_and_lse():
    q, k, v = (t[0].detach() for t in sdpa_inputs())
    out = qkv.attention(q, k, v, is_causal=True)
    assert out.shape == (4, L, E)
    assert rel_err(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)) < 1e-12
    out2, weights, lse = qkv.attention(q, k, v, is_causal=True, return_weights=True,
                                       return_lse=True)
    assert weights.shape == (4, L, S) and lse.shape == (4, L)
    assert rel_err(out2, out) < 1e-12
    with pytest.raises(ValueError, match=r"q must be a 4-D tensor \(B, H, Nq, D\), or q, k "
                                         r"and v all 3-D \(unbatched\)"):
        qkv.attention(q, k.unsqueeze(0), v)


def test_a_float_bias_gets_sdpas_gradient():
    inputs = sdpa_inputs()
    bias = torch.randn(1, 4, L, S, generator=torch.Generator().manual_seed(6),
                       dtype=torch.float64).requires_grad_()
    (out, grads), (ref, ref_grads) = both({"attn_mask": bias}, inputs=inputs,
                                          extra_grads=[bias])
    assert rel_err(out, ref) < 1e-12
    assert all(rel_err(g, r) < 1e-12 for g, r in zip(grads, ref_grads, strict=True))
    # The fused engine, forced, computes the same.
    fused = qkv.attention(*inputs, attn_mask=bias, backend="fused")
    assert rel_err(fused, ref) < 1e-12
    (g_bias,) = torch.autograd.grad(fused.square().sum(), [bias])
    assert rel_err(g_bias, ref_grads[-1]) < 1e-12


def test_a_float_mask_with_a_fully_masked_row_gives_zeros_not_nan():
    q, k, v = sdpa_inputs()
    bias = torch.randn(L, S, dtype=torch.float64)
    bias[3] = float("-inf")
    out = qkv.attention(q, k, v, attn_mask=bias)
    assert not torch.isnan(out).any()
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    keep = torch.ones(L, dtype=torch.bool)
    keep[3] = False
    ref = F.scaled_dot_product_attention(q[:, :, keep], k, v, attn_mask=bias[keep])
    assert rel_err(out[:, :, keep], ref) < 1e-12


def shape_of(q, k):
    return q.shape[0], q.shape[1], q.shape[2], k.shape[2]


def test_structured_float_masks_become_qkv_masks_and_keep_the_fast_paths():
    q, k, v = (t.detach() for t in sdpa_inputs(nq=S))
    cases = [
        (additive(bool_tril(S, S)), "causal()", "sdpa"),
        (torch.zeros(S, S, dtype=torch.float64), "None", "sdpa"),
    ]
    for float_mask, expected_mask, expected_engine in cases:
        mask, mod = _spelled_mask(q, k, float_mask, None, None, False, None, None)
        assert repr(mask) == expected_mask and mod is None
        assert engines.plan(build_problem(q, k, v, mask=mask)).engine == expected_engine
    # A bias with -inf entries keeps them as a mask too, so that empty tiles are skipped.
    bias = torch.randn(S, S, dtype=torch.float64).masked_fill(~bool_tril(S, S), float("-inf"))
    mask, mod = _spelled_mask(q, k, bias, None, None, False, None, None)
    assert repr(mask) == "causal()" and repr(mod) == "additive_bias((1, 1, 20, 20))"
    # A user's score_mod comes first, the additive mask last (as a mask is applied last).
    mask, mod = _spelled_mask(q, k, bias, None, None, False, None, qkv.softcap(5.0))
    assert [type(m).__name__ for m in mod] == ["Softcap", "AdditiveBias"]


def test_qkv_causal_is_bottom_right_and_is_causal_top_left():
    q, k, v = (t.detach() for t in sdpa_inputs())
    bottom = qkv.attention(q, k, v, mask=qkv.causal())
    top = qkv.attention(q, k, v, is_causal=True)
    assert rel_err(top, qkv.attention(q, k, v, mask=qkv.causal(align="top_left"))) < 1e-15
    assert rel_err(bottom, F.scaled_dot_product_attention(q, k, v, attn_mask=bool_tril(
        L, S, S - L))) < 1e-12
    assert (bottom - top).abs().max() > 0.1
    with pytest.raises(ValueError, match="causal: align must be one of"):
        qkv.causal(align="left")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_decode_steps_causal_mask_sees_every_key_on_sdpa(bias, dtype):
    """One query aligned bottom-right sees every key: SDPA runs it without a mask (and not
    with its top-left is_causal, which would leave the query key 0 alone), with or without
    a float bias."""
    q, k, v = (t.detach() for t in sdpa_inputs(h=4, hkv=2, nq=1, dtype=dtype))
    kw = dict(mask=qkv.causal())
    if bias:
        kw["attn_mask"] = torch.randn(2, 4, 1, S, generator=torch.Generator().manual_seed(1),
                                      dtype=dtype)
    got = qkv.attention(q, k, v, **kw, backend="sdpa")
    if not bias:  # what a decode step picks
        assert qkv.explain(q, k, v, **kw).engine == "sdpa"
    want = qkv.attention(q, k, v, **kw, backend="reference")
    assert rel_err(got, want) < (1e-12 if dtype == torch.float64 else 1e-5)
    top_left = qkv.attention(q, k, v, is_causal=True)
    assert rel_err(top_left, v[:, :, :1].repeat_interleave(2, 1)) < 1e-6


DOCS = torch.tensor([0] * 30 + [1] * 50 + [2] * 20)


def document_causal(b, h, q_idx, kv_idx):
    return (DOCS[q_idx] == DOCS[kv_idx]) & (q_idx >= kv_idx)


def dense_reference(q, k, v, allowed):
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("spelling", ["block_mask", "mask=BlockMask", "mask=mask_mod"])
def test_flex_document_mask(spelling):
    n = DOCS.numel()
    block_mask = create_block_mask(document_causal, None, None, n, n, device="cpu",
                                   BLOCK_SIZE=16)
    q, k, v = sdpa_inputs(nq=n, nk=n)
    kwargs = {"block_mask": {"block_mask": block_mask}, "mask=BlockMask": {"mask": block_mask},
              "mask=mask_mod": {"mask": document_causal}}[spelling]
    out = qkv.attention(q, k, v, **kwargs)
    flex = flex_attention(q.detach(), k.detach(), v.detach(), block_mask=block_mask)
    assert rel_err(out, flex) < 1e-12
    allowed = (DOCS[:, None] == DOCS[None, :]) & bool_tril(n, n)
    ref = dense_reference(q, k, v, allowed)
    grads = torch.autograd.grad(out.square().sum(), [q, k, v])
    ref_grads = torch.autograd.grad(ref.square().sum(), [q, k, v])
    assert all(rel_err(g, r) < 1e-12 for g, r in zip(grads, ref_grads, strict=True))


def test_a_block_mask_keeps_flex_meaning_of_full_and_partial_tiles():
    """Full tiles are taken whole, without the rule; tiles in neither table are skipped: the
    meaning of FlexAttention's kernels (its unfused eager path, which CPU runs without
    torch.compile, evaluates the rule everywhere and ignores the tables)."""
    n, block = 64, 16
    nb = n // block
    # Query block i: partial on key block i (where the rule, kv even, applies), full on block 0.
    partial_num = torch.ones(1, 1, nb, dtype=torch.int32)
    partial_idx = torch.arange(nb, dtype=torch.int32).view(1, 1, nb, 1).expand(1, 1, nb, nb)
    full_num = torch.tensor([[[0] + [1] * (nb - 1)]], dtype=torch.int32)
    full_idx = torch.zeros(1, 1, nb, nb, dtype=torch.int32)
    block_mask = BlockMask.from_kv_blocks(partial_num, partial_idx.contiguous(), full_num,
                                          full_idx, BLOCK_SIZE=block,
                                          mask_mod=lambda b, h, q, kv: kv % 2 == 0,
                                          seq_lengths=(n, n))
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = ((qi // block == ki // block) & (ki % 2 == 0)) | ((ki // block == 0) & (
        qi >= block))
    q, k, v = (t.detach() for t in sdpa_inputs(nq=n, nk=n))
    out = qkv.attention(q, k, v, block_mask=block_mask)
    assert rel_err(out, dense_reference(q, k, v, allowed)) < 1e-12
    assert rel_err(qkv.attention(q, k, v, block_mask=block_mask, backend="fused"),
                   dense_reference(q, k, v, allowed)) < 1e-12


def test_a_block_mask_for_another_length_is_refused():
    block_mask = create_block_mask(document_causal, None, None, 100, 100, device="cpu")
    q, k, v = sdpa_inputs()
    with pytest.raises(ValueError, match=r"block_mask was made for \(Q_LEN, KV_LEN\) = "
                                         r"\(100, 100\).*\(Nq, Nk\) = \(12, 20\)"):
        qkv.attention(q, k, v, block_mask=block_mask)
    with pytest.raises(TypeError, match="block_mask must be a FlexAttention BlockMask; got "
                                        "Tensor"):
        qkv.attention(q, k, v, block_mask=torch.ones(L, S, dtype=torch.bool))


@pytest.mark.parametrize("keyword,qkv_form", [
    ("need_weights", "return_weights=True"),
    ("average_attn_weights", "weights.mean(dim=1)"),
    ("key_padding_mask", "mask=qkv.padding(lengths)"),
    ("attn_bias", "attn_mask=bias"),
    ("causal", "is_causal=True"),
    ("softmax_scale", "scale="),
    ("window_size", "mask=qkv.sliding_window"),
    ("alibi_slopes", "score_mod=qkv.alibi"),
    ("softcap", "score_mod=qkv.softcap(cap)"),
    ("dropout", "dropout_p="),
    ("return_aux", "return_lse=True"),
    ("kernel_options", "leave kernel_options out"),
])
def test_other_apis_keywords_name_the_qkv_form(keyword, qkv_form):
    q, k, v = sdpa_inputs()
    with pytest.raises(TypeError) as info:
        qkv.attention(q, k, v, **{keyword: True})
    message = str(info.value)
    assert "\n" not in message and repr(keyword) in message and qkv_form in message


def test_bad_mask_spellings_get_one_line():
    q, k, v = sdpa_inputs()
    with pytest.raises(TypeError, match="unexpected keyword argument 'nonsense'; it takes "
                                        "attn_mask, dropout_p, is_causal, mask"):
        qkv.attention(q, k, v, nonsense=1)
    with pytest.raises(TypeError, match="attn_mask got a 5-argument callable.*score_mod="):
        qkv.attention(q, k, v, attn_mask=lambda score, b, h, q_idx, kv_idx: score)
    with pytest.raises(ValueError, match=r"attn_mask of shape \(3, 20\) does not broadcast"):
        qkv.attention(q, k, v, attn_mask=torch.zeros(3, S))
    with pytest.raises(TypeError, match="mask must be a bool or float tensor; got dtype "
                                        "torch.int64"):
        qkv.attention(q, k, v, mask=torch.ones(L, S, dtype=torch.long))
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        qkv.attention(q, k, v, is_causal="yes")
