"""float64 gradcheck of the reference for every registered similarity (built-in and the
user-defined examples) x mask kind x score modifier, with the tensors a similarity reads."""

import pytest
import torch

import qkv

from .conftest import EXAMPLE_D, mask_cases, rand_qkv, registered_similarities, similarity_inputs

B, H, HKV, NQ, NK, D, DV = 2, 2, 1, 4, 5, EXAMPLE_D, 2
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
@pytest.mark.parametrize("similarity", registered_similarities(D))
def test_reference_gradcheck(similarity, mask_name, mod_kind):
    q, k, v = rand_qkv(B, H, HKV, NQ, NK, D, DV, requires_grad=True)
    mask = mask_cases(B, NQ, NK)[mask_name]
    g = torch.Generator().manual_seed(2)
    metric, learnable = similarity_inputs(similarity, H, D)
    params = {
        "slopes": torch.rand(H, generator=g, dtype=torch.float64).requires_grad_(),
        "table": torch.randn(4, H, generator=g, dtype=torch.float64).requires_grad_(),
    }
    # gradcheck perturbs its inputs in place, so a user term sees the perturbed tensors it reads.
    inputs = [q, k, v, *learnable]
    if mod_kind == "alibi_softcap":
        inputs.append(params["slopes"])
    if mod_kind == "relative_bias":
        inputs.append(params["table"])

    def fn(*tensors):
        q_, k_, v_ = tensors[:3]
        rest = list(tensors[3 + len(learnable):])
        m = tensors[3] if metric is not None else None
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

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5, rtol=1e-4,
                                    fast_mode=True)
