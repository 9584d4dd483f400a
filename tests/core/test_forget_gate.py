"""Forgetting attention's modifier ``qkv.forget_gate(log_f)``: equal to a float64 reference
written here from the paper's formula and to flash-linear-attention's naive implementation,
outputs and every gradient (log_f's included), on the reference and the fused engine, and
traced from its one definition into the C loops and the Triton functions."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.core.similarity import DOT
from qkv.engines.cpu import native
from qkv.engines.kernelgen import c_mod
from qkv.engines.lowering import Lowered
from qkv.engines.triton.traced import trace_functions

from .conftest import rand_qkv, rel_err

BACKENDS = ("reference", "fused")


def formula(q, k, v, log_f):
    """Forgetting attention from the paper, in float64: o_i = Σ_j≤i exp(s_ij) v_j / Σ exp(s_ij)
    with s_ij = q_i·k_j / √D + Σ_{l=j+1..i} log f_l, the query i at key position i + Nk - Nq;
    the sum over l is taken term by term, not as a difference of cumulative sums."""
    q, k, v, log_f = (t.double() for t in (q, k, v, log_f))
    h, nq, nk = q.shape[1], q.shape[2], k.shape[2]
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    log_f = log_f.expand(q.shape[0], h, nk)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    decay = torch.zeros_like(s)
    for i in range(nq):
        position = i + nk - nq
        for j in range(position):
            decay[:, :, i, j] = log_f[:, :, j + 1:position + 1].sum(-1)
    allowed = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
    s = (s + decay).masked_fill(~allowed, float("-inf"))
    return torch.softmax(s, -1) @ v


def _log_f(shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    # logsigmoid of logits around +2: forget values mostly near 1, as trained gates are
    return F.logsigmoid(2 + torch.randn(shape, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("nq", "nk", "gate_shape"), [
    (33, 33, (2, 4, 33)), (5, 40, (2, 4, 40)), (20, 20, (1, 1, 20)),
])
def test_forget_gate_equals_the_formula(backend, nq, nk, gate_shape):
    q, k, v = (t.requires_grad_() for t in rand_qkv(b=2, h=4, hkv=2, nq=nq, nk=nk, d=8, dv=5))
    log_f = _log_f(gate_shape).requires_grad_()
    inputs = (q, k, v, log_f)
    want = formula(*inputs)
    grads_want = torch.autograd.grad(want.square().sum(), inputs)
    got = qkv.attention(q, k, v, mask=qkv.causal(), score_mod=qkv.forget_gate(log_f),
                        backend=backend)
    assert rel_err(got, want) < 1e-12
    for g, g_want in zip(torch.autograd.grad(got.square().sum(), inputs), grads_want,
                         strict=True):
        assert rel_err(g, g_want) < 1e-10


def _fla_naive():
    """flash-linear-attention's naive forgetting attention, its file loaded by itself (it
    imports only torch and einops): the package's own __init__ needs Triton's GPU runtime."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / "ops/forgetting_attn/naive.py"
    module_spec = importlib.util.spec_from_file_location("fla_naive_forgetting", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.naive_forgetting_attn


@pytest.mark.parametrize("backend", BACKENDS)
def test_forget_gate_equals_flash_linear_attention(backend):
    naive = _fla_naive()
    q, k, v = (t.float().requires_grad_() for t in rand_qkv(b=2, h=4, hkv=2, nq=48, nk=48,
                                                               d=8, dv=8))
    log_f = _log_f((2, 4, 48)).float().requires_grad_()
    inputs = (q, k, v, log_f)
    # fla's layout is [B, T, H, D] and g = log_f [B, T, H]; it computes in float32.
    want = naive(*(t.transpose(1, 2) for t in inputs), scale=8 ** -0.5).transpose(1, 2)
    grads_want = torch.autograd.grad(want.square().sum(), inputs)
    exact = formula(*inputs)
    grads_exact = torch.autograd.grad(exact.square().sum(), inputs)
    got = qkv.attention(q, k, v, mask=qkv.causal(), score_mod=qkv.forget_gate(log_f),
                        backend=backend)
    assert got.dtype == torch.float32
    # Two float32 computations of the same sums, each within ~1e-6 of float64.
    assert rel_err(got, want) < 1e-5
    assert rel_err(want, exact) < 1e-5 and rel_err(got, exact) < 1e-5
    grads = torch.autograd.grad(got.square().sum(), inputs)
    for g, g_fla, g_exact in zip(grads, grads_want, grads_exact, strict=True):
        assert rel_err(g, g_fla) < 1e-5
        assert rel_err(g_fla, g_exact) < 1e-5 and rel_err(g, g_exact) < 1e-5


def test_forget_gate_runs_fused_in_code_traced_from_its_definition():
    gate = qkv.forget_gate(_log_f((2, 4, 16)))
    q, k, v = rand_qkv(b=2, h=4, hkv=2, nq=16, nk=16, d=8, dv=4)
    assert qkv.explain(q, k, v, mask=qkv.causal(), score_mod=gate).engine == "fused"
    traced = c_mod.traced_mod(gate, torch.float64)
    assert (traced is not None) == native.available(torch.float64)
    log_f = _log_f((2, 4, 64)).float().requires_grad_()
    gate = qkv.forget_gate(log_f)
    functions = trace_functions(Lowered(DOT, gate, qkv.causal(), None), torch.device("cpu"),
                                16, 64)
    assert functions.has_mod and functions.slots[0] is gate.cumulative
    assert functions.grad_slots == {0}


def test_forget_gate_refuses_bad_input():
    with pytest.raises(ValueError, match=r"log_f must be a float tensor \(B, H, N\)"):
        qkv.forget_gate(torch.zeros(2, 8))
    with pytest.raises(ValueError, match="log_f must be a float tensor"):
        qkv.forget_gate(torch.zeros(1, 2, 8, dtype=torch.long))
    q, k, v = rand_qkv(b=1, h=4, hkv=2, nq=8, nk=8)
    with pytest.raises(ValueError, match="forget_gate has log_f for 3 heads but the attention "
                                         "has 4 query heads"):
        qkv.attention(q, k, v, score_mod=qkv.forget_gate(torch.zeros(1, 3, 8)))
