"""Weightings (how scores become weights): each equals a float64 reference written here from
its formula, on the reference and the fused CPU engine, for outputs and every gradient,
crossed with masks, similarities, grouped heads and Nq != Nk; and the two outside
implementations (x-transformers' sigmoid attention, flash-linear-attention's stick-breaking)."""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F

import qkv
from qkv.core.weighting import Carry

from ..versions import one_graph
from .conftest import rand_qkv, rel_err

NAMES = ["sigmoid", "softpick", "stick_breaking", "relu", "identity"]


def cube(s):
    """A user's elementwise weighting: a smooth odd function of the score."""
    return s * torch.tanh(s) * 0.5


def formula_weights(name, s, allowed, offset, include_self=False, bias=None, eps=1e-6):
    """The weights (B, H, Nq, Nk) from the formulas of the weighting table, in float64, with
    explicit loops where the formula has a product (stick-breaking)."""
    nq, nk = s.shape[-2:]
    zero = torch.zeros((), dtype=s.dtype)
    safe = torch.where(allowed, s, zero)
    if name == "softmax":
        e = torch.where(allowed, torch.exp(safe - safe.amax(-1, keepdim=True)), zero)
        return e / e.sum(-1, keepdim=True).clamp_min(1e-300)
    if name == "sigmoid":
        b = -math.log(nk) if bias is None else bias
        if isinstance(b, torch.Tensor):
            b = b.view(1, -1, 1, 1)
        return torch.where(allowed, torch.sigmoid(safe + b), zero)
    if name == "softpick":
        num = torch.where(allowed, torch.relu(torch.exp(safe) - 1), zero)
        den = torch.where(allowed, (torch.exp(safe) - 1).abs(), zero).sum(-1, keepdim=True)
        return num / (den + eps)
    if name == "relu":
        return torch.where(allowed, torch.relu(safe) / nk, zero)
    if name == "identity":
        return torch.where(allowed, safe, zero)
    if name == "cube":
        return torch.where(allowed, cube(safe), zero)
    assert name == "stick_breaking"
    beta = torch.sigmoid(safe)
    rows = []
    for i in range(nq):
        pos = i + offset
        cols = []
        for j in range(nk):
            ok = allowed[..., i, j] & ((j <= pos) if include_self else (j < pos))
            w = beta[..., i, j]
            for m in range(j + 1, (pos + 1) if include_self else pos):
                w = w * torch.where(allowed[..., i, m], 1 - beta[..., i, m], 1.0)
            cols.append(torch.where(ok, w, zero))
        rows.append(torch.stack(cols, -1))
    return torch.stack(rows, -2)


def scores_and_allowed(q, k, mask, similarity="dot", scale=None):
    """Dense scores (B, H, Nq, Nk) and the mask, written here without qkv's engines."""
    h, d = q.shape[1], q.shape[-1]
    kk = k.repeat_interleave(h // k.shape[1], dim=1)
    if similarity == "dot":
        s = (q @ kk.transpose(-1, -2)) * (scale if scale is not None else d ** -0.5)
    elif similarity == "cosine":
        s = F.normalize(q, dim=-1) @ F.normalize(kk, dim=-1).transpose(-1, -2)
        s = s * (scale if scale is not None else d ** 0.5)
    elif similarity == "l1":
        s = -(q.unsqueeze(-2) - kk.unsqueeze(-3)).abs().sum(-1) * d ** -0.5
    else:
        assert similarity == "l2"
        s = -(q.unsqueeze(-2) - kk.unsqueeze(-3)).square().sum(-1) * d ** -0.5
    nq, nk = q.shape[2], k.shape[2]
    allowed = (torch.ones(1, 1, nq, nk, dtype=torch.bool) if mask is None else
               mask.materialize(q.shape[0], h, nq, nk))
    return s, allowed.expand(s.shape)


def weighting_of(name, **kw):
    if name == "cube":
        return qkv.weighting.elementwise(cube)
    return qkv.weighting.WEIGHTINGS[name](**kw)


MASKS = {
    "causal": lambda b, nq, nk: qkv.causal(),
    "window": lambda b, nq, nk: qkv.causal() & qkv.sliding_window(9),
    "padding": lambda b, nq, nk: qkv.causal() & qkv.padding([nk, nk - 7][:b]),
    "segments": lambda b, nq, nk: qkv.causal() & qkv.segments(
        (torch.arange(nk) // 11).expand(b, nk).contiguous()),
}


@pytest.mark.parametrize("name", [*NAMES, "cube"])
@pytest.mark.parametrize("mask_name", list(MASKS))
def test_each_weighting_equals_its_formula_on_every_engine(name, mask_name):
    nq = nk = 37
    q, k, v = (t.requires_grad_() for t in rand_qkv(h=4, hkv=2, nq=nq, nk=nk, d=8, dv=5))
    mask = MASKS[mask_name](2, nq, nk)
    s, allowed = scores_and_allowed(q, k, mask)
    w = formula_weights(name, s, allowed, nk - nq)
    want = w @ v.repeat_interleave(2, dim=1)
    grads_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for backend in ("reference", "fused"):
        with torch.no_grad():
            out, weights = qkv.attention(q, k, v, mask=mask, weighting=weighting_of(name),
                                         backend=backend, return_weights=True)
        assert rel_err(out, want) < 1e-12, backend
        assert rel_err(weights, w) < 1e-12, backend
        got = qkv.attention(q, k, v, mask=mask, weighting=weighting_of(name), backend=backend)
        for g, g_want in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads_want,
                             strict=True):
            assert rel_err(g, g_want) < 1e-10, backend


@pytest.mark.parametrize("name", [n for n in NAMES if n != "stick_breaking"])
@pytest.mark.parametrize("similarity", ["dot", "cosine", "l1", "l2"])
def test_weightings_compose_with_similarities_and_no_mask(name, similarity):
    q, k, v = (t.requires_grad_() for t in rand_qkv(h=2, hkv=1, nq=13, nk=29, d=4, dv=3))
    s, allowed = scores_and_allowed(q, k, None, similarity)
    want = formula_weights(name, s, allowed, 16) @ v.repeat_interleave(2, dim=1)
    grads_want = torch.autograd.grad(want.sum(), (q, k, v))
    got = qkv.attention(q, k, v, similarity=similarity, weighting=name, backend="fused")
    assert rel_err(got, want) < 1e-12
    for g, g_want in zip(torch.autograd.grad(got.sum(), (q, k, v)), grads_want, strict=True):
        assert rel_err(g, g_want) < 1e-10


@pytest.mark.parametrize("include_self", [False, True])
def test_stick_breaking_under_a_kv_cache_is_bottom_right_aligned(include_self):
    q, k, v = (t.requires_grad_() for t in rand_qkv(h=2, hkv=2, nq=6, nk=20, d=4, dv=3))
    s, allowed = scores_and_allowed(q, k, qkv.causal())
    w = formula_weights("stick_breaking", s, allowed, 14, include_self=include_self)
    weighting = qkv.weighting.stick_breaking(include_self=include_self)
    for backend in ("reference", "fused"):
        out = qkv.attention(q, k, v, mask=qkv.causal(), weighting=weighting, backend=backend)
        assert rel_err(out, w @ v) < 1e-12


def test_a_learnable_sigmoid_bias_gets_its_gradient():
    q, k, v = (t.requires_grad_() for t in rand_qkv(h=4, hkv=2, nq=21, nk=21, d=4, dv=3))
    bias = torch.tensor([-1.0, -0.5, 0.0, 0.5], dtype=torch.float64, requires_grad=True)
    s, allowed = scores_and_allowed(q, k, qkv.causal())
    want = formula_weights("sigmoid", s, allowed, 0, bias=bias) @ v.repeat_interleave(2, 1)
    grads_want = torch.autograd.grad(want.square().sum(), (q, k, v, bias))
    for backend in ("reference", "fused"):
        out = qkv.attention(q, k, v, mask=qkv.causal(), backend=backend,
                            weighting=qkv.weighting.sigmoid(bias=bias))
        grads = torch.autograd.grad(out.square().sum(), (q, k, v, bias))
        for g, g_want in zip(grads, grads_want, strict=True):
            assert rel_err(g, g_want) < 1e-10, backend


def test_a_user_elementwise_weighting_reaches_the_tensors_it_reads():
    q, k, v = (t.requires_grad_() for t in rand_qkv(h=2, hkv=2, nq=9, nk=9, d=4, dv=3))
    temperature = torch.tensor(0.7, dtype=torch.float64, requires_grad=True)
    grads = []
    for backend in ("reference", "fused"):
        weighting = qkv.weighting.elementwise(lambda s: torch.sigmoid(s / temperature))
        out = qkv.attention(q, k, v, weighting=weighting, backend=backend)
        grads.append(torch.autograd.grad(out.sum(), (q, temperature)))
    for fused, reference in zip(*grads, strict=True):
        assert rel_err(fused, reference) < 1e-12
    assert grads[1][1].abs() > 0


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_in_float64(name):
    q, k, v = (t.requires_grad_() for t in rand_qkv(b=1, h=2, hkv=1, nq=6, nk=6, d=3, dv=2))

    def fn(q, k, v):
        return qkv.attention(q, k, v, mask=qkv.causal() & qkv.sliding_window(3),
                             weighting=name, backend="fused")

    assert torch.autograd.gradcheck(fn, (q, k, v))


@pytest.mark.parametrize("name", NAMES)
def test_a_row_with_no_allowed_key_gives_zeros_and_zero_gradients(name):
    q, k, v = (t.requires_grad_() for t in rand_qkv(b=2, h=2, hkv=2, nq=5, nk=5, d=3, dv=2))
    mask = qkv.causal() & qkv.padding([5, 0])  # the second sequence has no key at all
    for backend in ("reference", "fused"):
        out = qkv.attention(q, k, v, mask=mask, weighting=name, backend=backend)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        for g in (dq, dk, dv):
            assert torch.isfinite(g).all() and (g[1] == 0).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_matches_float64(name, dtype):
    """Outputs against float64; gradients against the reference on the same inputs, since
    relu's and softpick's kink at s = 0 moves gradients wherever rounding moves a score
    across it (the float32 reference is 6e-4 off float64 there, like the engine)."""
    q, k, v = rand_qkv(h=4, hkv=2, nq=300, nk=300, d=16, dv=8, seed=3)
    want = qkv.attention(q, k, v, mask=qkv.causal(), weighting=name, backend="reference")
    results = []
    for backend in ("fused", "reference"):
        low = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        got = qkv.attention(*low, mask=qkv.causal(), weighting=name, backend=backend)
        assert got.dtype == dtype
        results.append((got, *torch.autograd.grad(got.float().square().sum(), low)))
    assert rel_err(results[0][0], want) < (1e-5 if dtype == torch.float32 else 2e-2)
    for fused, reference in zip(*results, strict=True):
        assert rel_err(fused, reference) < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("name", NAMES)
def test_dropout_drops_the_weights_that_multiply_v(name):
    q, k, v = rand_qkv(h=2, hkv=2, nq=40, nk=40, d=4, dv=3)
    torch.manual_seed(5)
    out, weights = qkv.attention(q, k, v, mask=qkv.causal(), weighting=name, dropout_p=0.3,
                                 return_weights=True, backend="fused")
    assert rel_err(out, weights @ v) < 1e-12
    plain = qkv.attention(q, k, v, mask=qkv.causal(), weighting=name, return_weights=True,
                          backend="fused")[1]
    kept = weights != 0
    assert 0.5 < kept.sum() / (plain != 0).sum() < 0.9
    assert rel_err(weights[kept], plain[kept] / 0.7) < 1e-12


def test_x_transformers_sigmoid_attention_equals_sigmoid_with_bias_zero():
    attend = pytest.importorskip("x_transformers.attend").Attend(sigmoid=True, causal=True)
    q, k, v = rand_qkv(b=2, h=4, hkv=4, nq=33, nk=33, d=8, dv=8)
    want, _ = attend(q, k, v)
    for backend in ("reference", "fused"):
        got = qkv.attention(q, k, v, mask=qkv.causal(), backend=backend,
                            weighting=qkv.weighting.sigmoid(bias=0.0))
        assert rel_err(got, want) < 1e-12


def _fla_naive(relative: str):
    """A file of flash-linear-attention's, loaded by itself (it imports only torch and
    einops): the package's own __init__ needs Triton's GPU runtime."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("fla-core is not installed")
    path = pathlib.Path(spec.submodule_search_locations[0]) / relative
    module_spec = importlib.util.spec_from_file_location(f"fla_naive_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("include_self", [False, True])
def test_flash_linear_attentions_stick_breaking_equals_ours(include_self):
    naive = _fla_naive("ops/stickbreaking_attn/naive.py").naive_stickbreaking_attn
    q, k, v = (t.requires_grad_() for t in rand_qkv(b=2, h=4, hkv=2, nq=70, nk=70, d=8, dv=6))
    want, remaining = naive(*(t.transpose(1, 2) for t in (q, k, v)), attend_current=include_self)
    want = want.transpose(1, 2)
    grads_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    weighting = qkv.weighting.stick_breaking(include_self=include_self)
    for backend in ("reference", "fused"):
        with torch.no_grad():
            got, weights = qkv.attention(q, k, v, mask=qkv.causal(), weighting=weighting,
                                         backend=backend, return_weights=True)
        assert rel_err(got, want) < 1e-12
        assert rel_err(1 - weights.sum(-1), remaining.transpose(1, 2)) < 1e-12
        got = qkv.attention(q, k, v, mask=qkv.causal(), weighting=weighting, backend=backend)
        for g, g_want in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads_want,
                             strict=True):
            assert rel_err(g, g_want) < 1e-10


@pytest.mark.parametrize("name", ["sigmoid", "relu", "identity", "cube"])
def test_graph_engine_runs_the_elementwise_weightings_along_edges(name):
    """The sparse graph engine: weights straight from the modified score of each edge, a
    learnable scale and a target with no edge included (zeros, zero gradients)."""
    torch.manual_seed(3)
    n = 64
    target, source = torch.randint(0, n - 1, (2, 90))  # node n - 1 has no incoming edge
    mask = qkv.graph(torch.stack([target, source]), n)
    q, k, v = rand_qkv(h=4, hkv=2, nq=n, nk=n, d=5, dv=3, requires_grad=True)
    scale = torch.full((4,), 0.4, dtype=torch.float64, requires_grad=True)
    weighting = qkv.weighting.elementwise(cube) if name == "cube" else name
    kw = dict(mask=mask, weighting=weighting, scale=scale)
    assert qkv.explain(q, k, v, **kw).engine == "graph"
    got = qkv.attention(q, k, v, **kw)
    want = qkv.attention(q, k, v, backend="reference", **kw)
    assert rel_err(got, want) < 1e-12
    assert got[:, :, n - 1].abs().max() == 0
    inputs = (q, k, v, scale)
    grads = torch.autograd.grad(got.square().sum(), inputs)
    wants = torch.autograd.grad(want.square().sum(), inputs)
    for g, g_want in zip(grads, wants, strict=True):
        assert rel_err(g, g_want) < 1e-10


def test_identity_with_cosine_and_scale_one_is_content_based_attention():
    q, k, v = rand_qkv(h=2, hkv=2, nq=11, nk=11, d=4, dv=3)
    want = (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-1, -2)) @ v
    got = qkv.attention(q, k, v, similarity="cosine", scale=1.0, weighting="identity")
    assert rel_err(got, want) < 1e-12


def test_explain_names_the_engine_and_every_refusal():
    q, k, v = rand_qkv(h=2, hkv=2, nq=11, nk=11, d=4, dv=3, dtype=torch.float32)
    plain = qkv.explain(q, k, v)
    assert plain.engine in ("flash", "sdpa") and isinstance(plain.refused, tuple)
    sig = qkv.explain(q, k, v, weighting="sigmoid")
    assert sig.engine == "fused"
    assert "sigmoid" in dict(sig.refused)["sdpa"]
    edges = torch.tensor([[0, 1, 2], [0, 0, 1]])
    on_graph = qkv.explain(q[..., :3, :], k[..., :3, :], v[..., :3, :], mask=qkv.graph(edges, 3),
                           weighting="softpick")
    assert "softpick" in dict(on_graph.refused)["graph"]
    assert str(sig).splitlines()[0] == "runs on: fused"
    assert qkv.explain(q, k, v, backend="reference").engine == "reference"
    with pytest.raises(TypeError, match="need_weights"):
        qkv.explain(q, k, v, need_weights=True)


def test_bad_weightings_get_one_line_naming_the_argument():
    q, k, v = rand_qkv(h=2, hkv=2, nq=4, nk=4, d=4, dv=3)
    with pytest.raises(ValueError, match="weighting must be one of"):
        qkv.attention(q, k, v, weighting="sparsemax")
    with pytest.raises(TypeError, match="weighting must be a name"):
        qkv.attention(q, k, v, weighting=3)
    with pytest.raises(ValueError, match="return_lse=True needs a softmax.*sigmoid"):
        qkv.attention(q, k, v, weighting="sigmoid", return_lse=True)
    with pytest.raises(ValueError, match="sinks needs a softmax.*relu"):
        qkv.attention(q, k, v, weighting="relu", sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="pass mask=qkv.causal"):
        qkv.attention(q, k, v, weighting="stick_breaking")
    with pytest.raises(ValueError, match="lets a query see a later key"):
        qkv.attention(q, k, v, weighting="stick_breaking", mask=qkv.sliding_window(1, 1))
    with pytest.raises(ValueError, match="bias for 3 heads"):
        qkv.attention(q, k, v, weighting=qkv.weighting.sigmoid(bias=torch.zeros(3)))
    with pytest.raises(ValueError, match="softpick: eps must be a positive number"):
        qkv.weighting.softpick(eps=0)
    with pytest.raises(TypeError, match="include_self must be a bool"):
        qkv.weighting.stick_breaking(include_self="yes")
    # a graph mask whose edges include a later key, found by the tile check
    edges = torch.tensor([[0, 1, 2, 3], [0, 0, 3, 2]])  # (query, key): 2 sees the later 3
    with pytest.raises(ValueError, match="later key"):
        qkv.attention(q, k, v, weighting="stick_breaking", mask=qkv.graph(edges, 4))


def test_the_stick_check_passes_a_mask_once_per_layout_and_shape():
    """A decode step checks the same mask in every layer: a mask with a layout key is
    classified once per shape, and causal() needs no classification at all."""
    from qkv.core.weighting import stick

    q, k, v = rand_qkv(h=2, hkv=2, nq=6, nk=9, d=4, dv=3)
    window = qkv.sliding_window(3, 0)
    key = (window.layout_key(), 2, 2, 6, 9)
    assert not stick._IN_ORDER.get(key)
    first = qkv.attention(q, k, v, weighting="stick_breaking", mask=window)
    assert stick._IN_ORDER.get(key)
    again = qkv.attention(q, k, v, weighting="stick_breaking", mask=qkv.sliding_window(3, 0))
    assert torch.equal(first, again)
    with pytest.raises(ValueError, match="later key"):  # another window is checked anew
        qkv.attention(q, k, v, weighting="stick_breaking", mask=qkv.sliding_window(3, 1))


def test_carries_are_what_the_engines_branch_on():
    carries = {name: qkv.weighting.WEIGHTINGS[name]().carry for name in qkv.weighting.WEIGHTINGS}
    assert carries == {"softmax": Carry.MAX_SUM, "softpick": Carry.MAX_SUM,
                       "stick_breaking": Carry.STICK, "sigmoid": Carry.NONE,
                       "relu": Carry.NONE, "identity": Carry.NONE}


@pytest.mark.parametrize("name", [*NAMES, "cube"])
def test_the_built_in_weightings_run_in_the_c_blocks(name):
    """Where C builds, whole query blocks run in C: an elementwise weighting's function is
    traced into the modifier's loops, softpick and stick-breaking have loops of their own. A
    weighting the blocks have no loops for (a subclass of softpick) runs on tiles."""
    from qkv.core.problem import build_problem
    from qkv.engines.cpu import fused_cpu, native, paths
    from qkv.engines.lowering import lower

    if not native.available(torch.float32):
        pytest.skip("no C compiler")

    class Softpick2(qkv.weighting.Softpick):
        pass

    q, k, v = rand_qkv(h=2, hkv=2, nq=40, nk=40, d=4, dv=3, dtype=torch.float32)
    for weighting, path in ((weighting_of(name), paths.CpuPath.BLOCKS),
                            (Softpick2(), paths.CpuPath.TILES)):
        problem = build_problem(q, k, v, weighting=weighting, mask=qkv.causal())
        fq, fk, _, variant = lower(problem)
        assert paths.choose(fused_cpu._spec(fq, fk, variant, 0.0, 0), fq)[0] is path


@one_graph
@pytest.mark.parametrize("name", ["sigmoid", "softpick", "stick_breaking"])
def test_weightings_compile_fullgraph_and_export_as_custom_ops(name):
    q, k, v = (t.requires_grad_() for t in rand_qkv(b=1, h=2, hkv=2, nq=40, nk=40, d=4, dv=3,
                                                    dtype=torch.float32))
    bias = torch.tensor([-1.0, 0.5], requires_grad=True)
    weighting = qkv.weighting.sigmoid(bias=bias) if name == "sigmoid" else name

    def fn(q, k, v):
        return qkv.attention(q, k, v, mask=qkv.causal(), weighting=weighting)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    eager, traced = fn(q, k, v), compiled(q, k, v)
    targets = (q, k, v, bias) if name == "sigmoid" else (q, k, v)
    for a, b in zip(torch.autograd.grad(eager.sum(), targets),
                    torch.autograd.grad(traced.sum(), targets), strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(eager, traced)

    class Layer(torch.nn.Module):
        def forward(self, q, k, v):
            return fn(q, k, v)

    exported = torch.export.export(Layer(), tuple(t.detach() for t in (q, k, v)))
    ops = {str(node.target) for node in exported.graph.nodes}
    assert any("qkv" in op for op in ops), ops
    torch.testing.assert_close(exported.module()(q, k, v), eager)
