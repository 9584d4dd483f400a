"""A new score modifier is one definition: the engines derive their code from its __call__
(the C loops of the fused CPU engine, the Triton source), with no engine edited, and its
values and gradients, its tensor's included, equal the float64 reference's."""

from __future__ import annotations

import torch

import qkv
from qkv.core.scores import ScoreMod
from qkv.core.similarity import DOT
from qkv.engines.cpu import native
from qkv.engines.kernelgen import c_mod
from qkv.engines.lowering import Lowered
from qkv.engines.triton.traced import trace_functions

from .conftest import rand_qkv, rel_err


class SquashedBias(ScoreMod):
    """score - exp(weight[h]) · |q_idx - kv_idx| / (1 + |score|): a made-up modifier
    with a learnable per-head tensor, written once here and nowhere else."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, score, b, h, q_idx, kv_idx, offset=0):
        distance = (q_idx + offset - kv_idx).abs()
        return score - torch.exp(self.weight[h]) * distance / (1 + score.abs())

    def tensors(self):
        return (self.weight,)


def test_a_new_modifier_runs_fused_with_its_gradients():
    q, k, v = (t.requires_grad_() for t in rand_qkv(h=4, hkv=2, nq=45, nk=45, d=8, dv=4))
    results = []
    for backend in ("fused", "reference"):
        weight = torch.linspace(-1.0, 1.0, 4, dtype=torch.float64).requires_grad_()
        out = qkv.attention(q, k, v, mask=qkv.causal(), score_mod=SquashedBias(weight),
                            backend=backend)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v, weight))))
    for fused, reference in zip(*results, strict=True):
        assert rel_err(fused, reference) < 1e-10
    # The fused engine ran the modifier in C loops traced from __call__, where it can build.
    traced = c_mod.traced_mod(SquashedBias(torch.ones(4)), torch.float64)
    assert (traced is not None) == native.available(torch.float64)


def test_a_new_modifier_compiles_for_triton_from_the_same_definition():
    weight = torch.ones(4, requires_grad=True)
    variant = Lowered(DOT, SquashedBias(weight), qkv.causal(), None)
    traced = trace_functions(variant, torch.device("cpu"), 16, 64)
    assert traced.has_mod and traced.has_mask
    assert traced.slots[0] is weight and traced.grad_slots == {0}
    assert "def mod_fn(" in traced.source and "def mod_bwd_fn(" in traced.source
