"""float64 gradcheck of the reference for every similarity x mask kind x score modifier."""

import pytest
import torch

import qkv

from .conftest import mask_cases, rand_qkv

B, H, HKV, NQ, NK, D, DV = 2, 2, 1, 4, 5, 3, 2
SIMILARITIES = ["dot", "cosine", "l2", "l1", "mahalanobis"]
MASKS = list(mask_cases(B, NQ, NK))


def make_mod(kind, params):
    if kind == "none":
        return None
    if kind == "alibi_softcap":
        return [qkv.alibi(slopes=params["slopes"]), qkv.softcap(2.0)]
    if kind == "relative_bias":
        return qkv.relative_bias(params["table"], num_buckets=4, max_distance=8)
    raise AssertionError(kind)


@pytest.mark.parametrize("mod_kind", ["none", "alibi_softcap", "relative_bias"])
@pytest.mark.parametrize("mask_name", MASKS)
@pytest.mark.parametrize("similarity", SIMILARITIES)
def test_reference_gradcheck(similarity, mask_name, mod_kind):
    q, k, v = rand_qkv(B, H, HKV, NQ, NK, D, DV, requires_grad=True)
    mask = mask_cases(B, NQ, NK)[mask_name]
    g = torch.Generator().manual_seed(2)
    metric = torch.randn(H, D, D, generator=g, dtype=torch.float64, requires_grad=True)
    params = {
        "slopes": torch.rand(H, generator=g, dtype=torch.float64).requires_grad_(),
        "table": torch.randn(4, H, generator=g, dtype=torch.float64).requires_grad_(),
    }
    inputs = [q, k, v]
    if similarity == "mahalanobis":
        inputs.append(metric)
    if mod_kind == "alibi_softcap":
        inputs.append(params["slopes"])
    if mod_kind == "relative_bias":
        inputs.append(params["table"])

    def fn(*tensors):
        q_, k_, v_ = tensors[:3]
        rest = list(tensors[3:])
        m = rest.pop(0) if similarity == "mahalanobis" else None
        local = dict(params)
        if mod_kind == "alibi_softcap":
            local["slopes"] = rest.pop(0)
        if mod_kind == "relative_bias":
            local["table"] = rest.pop(0)
        out, w = qkv.attention(
            q_,
            k_,
            v_,
            mask=mask,
            score_mod=make_mod(mod_kind, local),
            similarity=similarity,
            metric=m,
            return_weights=True,
            backend="reference",
        )
        return out, w

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4)
