"""qkv.attention under torch.compile(fullgraph=True): every similarity (a user's too), every
mask kind and every built-in modifier runs on the same fused engine as in eager mode, in one
graph, with outputs within 1e-5 and gradients within 1e-4 of eager.

The cases are shared with the Triton engine's interpreter run (test_triton_engine.py), which
compiles ``TRITON_CASES`` (every similarity, mask and modifier of the matrix at least once)
with the Triton engine in front."""

import subprocess
import sys

import pytest
import torch
import torch._dynamo.testing

import qkv
from qkv import engines

from ..versions import ONE_GRAPH, one_graph

B, H, HKV, N, D = 2, 4, 2, 24, 8
OUT_TOLERANCE, GRAD_TOLERANCE = 1e-5, 1e-4
REL_TABLE = torch.randn(32, H, generator=torch.Generator().manual_seed(3)).requires_grad_()
USER_WEIGHT = torch.linspace(0.5, 1.5, D).requires_grad_()
USER_L1 = qkv.Similarity(lambda q, k: -USER_WEIGHT * (q - k).abs(), name="compile_user_l1")
SIMILARITIES = {"dot": "dot", "cosine": "cosine", "l2": "l2", "l1": "l1",
                "mahalanobis": "mahalanobis", "user_l1": USER_L1}


def make_mask(name):
    g = torch.Generator().manual_seed(1)
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 5 + [1] * 19])
    edges = torch.stack([torch.randint(0, N, (3 * N,), generator=g),
                         torch.randint(0, N, (3 * N,), generator=g)])
    return {
        "causal": qkv.causal,
        "window": lambda: qkv.sliding_window(5),
        "segments": lambda: qkv.segments(ids),
        "graph": lambda: qkv.graph(edges, num_nodes=N),
        "padding": lambda: qkv.padding(torch.tensor([N, 13])),
    }[name]()


def make_modifier(name):
    return {
        "alibi": lambda: qkv.alibi(H),
        "softcap": lambda: qkv.softcap(5.0),
        "relative_bias": lambda: qkv.relative_bias(REL_TABLE, bidirectional=True),
        "user_score_mod": lambda: (lambda s, b, h, qi, ki: s - 0.1 * (qi - ki).abs()),
    }[name]()


MASKS = ["causal", "window", "segments", "graph", "padding"]
MODIFIERS = ["alibi", "softcap", "relative_bias", "user_score_mod"]
# name -> (similarity, mask, modifier)
CASES = {f"{s}-{m}": (s, m, None) for s in SIMILARITIES for m in MASKS}
CASES.update({f"{s}-causal-{mod}": (s, "causal", mod) for s in ("dot", "l1") for mod in MODIFIERS})
# The Triton interpreter's share (a few seconds a case): every similarity, mask and modifier
# once, with the similarities rotating over the masks and modifiers.
TRITON_CASES = [f"{s}-{MASKS[i % len(MASKS)]}" for i, s in enumerate(SIMILARITIES)]
TRITON_CASES += [f"{('dot', 'l1')[i % 2]}-causal-{mod}" for i, mod in enumerate(MODIFIERS)]


def _inputs(similarity):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, N, D, generator=g, requires_grad=True)
    k = torch.randn(B, HKV, N, D, generator=g, requires_grad=True)
    v = torch.randn(B, HKV, N, D, generator=g, requires_grad=True)
    extra = []
    if similarity == "mahalanobis":
        extra.append((torch.eye(D) + 0.2 * torch.randn(H, D, D, generator=g)).requires_grad_())
    return [q, k, v, *extra]


def compile_errors(name: str) -> tuple[float, float]:
    """Case ``name`` eager and under torch.compile(fullgraph=True, backend="aot_eager"): the
    largest difference of the outputs and of every gradient (q, k, v, the metric and the
    tensors the variant reads)."""
    similarity, mask_name, modifier = CASES[name]
    mask = make_mask(mask_name)
    score_mod = None if modifier is None else make_modifier(modifier)
    tensors = _inputs(similarity)
    wanted = tensors + [t for t in (USER_WEIGHT, REL_TABLE)
                        if (t is USER_WEIGHT and similarity == "user_l1")
                        or (t is REL_TABLE and modifier == "relative_bias")]

    def fn(q, k, v, *metric):
        return qkv.attention(q, k, v, mask=mask, score_mod=score_mod,
                             similarity=SIMILARITIES[similarity],
                             metric=metric[0] if metric else None)

    def run(f):
        out = f(*tensors)
        return out, torch.autograd.grad(out.square().sum(), wanted)

    torch._dynamo.reset()
    eager, eager_grads = run(fn)
    compiled, compiled_grads = run(torch.compile(fn, backend="aot_eager", fullgraph=True))
    grad_error = max((a - b).abs().max().item()
                     for a, b in zip(eager_grads, compiled_grads, strict=True))
    return (compiled - eager).abs().max().item(), grad_error


@pytest.fixture
def no_reference(monkeypatch):
    """Every case here has a fused engine: the reference must not run, eager or compiled."""
    monkeypatch.setattr(engines, "ENGINES", [e for e in engines.ENGINES if e.name != "reference"])


@one_graph
@pytest.mark.parametrize("name", list(CASES))
def test_compiled_in_one_graph_matches_eager(no_reference, name):
    out_error, grad_error = compile_errors(name)
    assert out_error <= OUT_TOLERANCE and grad_error <= GRAD_TOLERANCE, (out_error, grad_error)


def _frames(fn, change, values, q) -> int:
    """How many times torch.compile compiles ``fn`` while ``change(value)`` runs before each
    call; each compiled output is checked against eager."""
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    for value in values:
        change(value)
        assert (compiled(q) - fn(q)).abs().max() <= OUT_TOLERANCE
    return counter.frame_count


@one_graph
def test_new_tensor_values_do_not_recompile():
    q = torch.randn(1, H, 16, D)
    cap, scale, slopes = torch.tensor(2.0), torch.tensor(0.3), torch.rand(H) + 0.1
    weight = torch.ones(D)
    user = qkv.Similarity(lambda a, b: -weight * (a - b).abs())
    calls = {
        "softcap cap": (lambda q: qkv.attention(q, q, q, score_mod=qkv.softcap(cap)),
                        lambda x: cap.fill_(x)),
        "scale": (lambda q: qkv.attention(q, q, q, similarity="l1", scale=scale),
                  lambda x: scale.fill_(x / 10)),
        "alibi slopes": (lambda q: qkv.attention(q, q, q, mask=qkv.causal(),
                                                 score_mod=qkv.alibi(slopes=slopes)),
                         lambda x: slopes.mul_(x)),
        "similarity tensor": (lambda q: qkv.attention(q, q, q, similarity=user),
                              lambda x: weight.mul_(x)),
    }
    for name, (fn, change) in calls.items():
        assert _frames(fn, change, [1.0, 2.0, 3.0, 0.5], q) == 1, name


@one_graph
def test_new_float_values_recompile_once_then_never():
    """A Python float is specialized on first sight, as everywhere in torch.compile; the
    first new value makes it symbolic, and it crosses qkv's ops as a tensor from then on."""
    q = torch.randn(1, H, 16, D)

    class Capped(torch.nn.Module):
        cap, scale = 2.0, 0.3

        def forward(self, q):
            return qkv.attention(q, q, q, similarity="l1", scale=self.scale,
                                 score_mod=qkv.softcap(self.cap))

    module = Capped()
    assert _frames(module, lambda x: setattr(module, "cap", x), [1.0, 2.0, 3.0, 4.0], q) == 2
    assert _frames(module, lambda x: setattr(module, "scale", x), [0.1, 0.2, 0.3, 0.4], q) == 2


BAD_CALLS = {
    "padding longer than Nk": (lambda q: qkv.attention(
        q, q, q, mask=qkv.padding(torch.tensor([20, 3])), similarity="l1"),
        "padding: lengths must be <= Nk=16; got max 20"),
    "negative padding": (lambda q: qkv.attention(
        q, q, q, mask=qkv.padding(torch.tensor([-1, 3])), similarity="l1"),
        "padding: lengths must be >= 0"),
    "scale shape": (lambda q: qkv.attention(q, q, q, scale=torch.ones(3), similarity="l1"),
                    "scale tensor must have shape () or (H,)=(2,); got (3,)"),
    "3-D q": (lambda q: qkv.attention(q[0], q, q), "q must be a 4-D tensor (B, H, Nq, D)"),
    "dropout": (lambda q: qkv.attention(q, q, q, dropout_p=1.5),
                "dropout_p must be a number in [0, 1); got 1.5"),
    "softcap": (lambda q: qkv.attention(q, q, q, score_mod=qkv.softcap(-1.0)),
                "softcap: cap must be a positive number"),
    "segments": (lambda q: qkv.attention(
        q, q, q, mask=qkv.segments(torch.zeros(5, dtype=torch.long))),
        "segments: q_ids has length 5; expected 16"),
}


@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_input_gives_the_eager_error_compiled(name):
    """The same ValueError compiled as eager. Checks of values inside tensors (padding
    lengths) run inside the engines' ops, so even fullgraph=True raises them as they are;
    an error raised while Dynamo traces reaches a fullgraph=True caller wrapped in Dynamo's
    "Observed exception", which quotes it."""
    fn, message = BAD_CALLS[name]
    q = torch.randn(2, 2, 16, D)
    for run in (fn, torch.compile(fn, backend="aot_eager")):
        torch._dynamo.reset()
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
                           .replace("[", r"\[")):
            run(q)
    if not ONE_GRAPH:
        return  # torch 2.11 refuses one graph of the call itself (tests/versions.py)
    torch._dynamo.reset()
    with pytest.raises(Exception) as raised:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(q)
    assert message in str(raised.value) or message in str(raised.value.__cause__)


def test_plain_and_causal_dot_still_reach_sdpa_compiled():
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    q = torch.randn(1, H, 16, D)
    for mask in (None, qkv.causal()):
        torch._dynamo.reset()
        torch.compile(lambda q, mask=mask: qkv.attention(q, q, q, mask=mask), backend=record,
                      fullgraph=True)(q)
        assert "scaled_dot_product_attention" in graphs[-1] and "qkv" not in graphs[-1]


@one_graph
def test_a_user_callable_with_an_empty_closure_cell_crosses_the_op():
    """A closure cell that is still empty (a name assigned after the function is defined) is
    skipped when the variant is taken apart, as when its tensors are listed for gradients."""
    q = torch.randn(1, H, 16, D)

    def make():
        def score_mod(s, b, h, qi, ki):
            return s - later * (qi - ki).abs()
        captured = torch.utils._pytree.tree_leaves(qkv.core.scores.as_score_mod(score_mod))
        later = 0.1
        return score_mod, captured

    score_mod, captured = make()
    assert captured == []

    def fn(q):
        return qkv.attention(q, q, q, mask=qkv.causal(), score_mod=score_mod)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(q)
    assert (compiled - fn(q)).abs().max() <= OUT_TOLERANCE


@one_graph
def test_importing_qkv_leaves_dynamo_unloaded_and_a_later_compile_keeps_the_op():
    """``import qkv`` does not import torch._dynamo (seconds of every command's start-up); a
    torch.compile started afterwards, in a fresh process, still finds the op's boundary (one
    graph with the nonstrict call, not a trace into it) and matches eager."""
    script = """
import sys, torch, qkv
assert "torch._dynamo" not in sys.modules, "import qkv imported torch._dynamo"
graphs = []
def record(gm, inputs):
    graphs.append(str(gm.graph))
    return gm
q = torch.randn(1, 2, 16, 8)
fn = lambda q: qkv.attention(q, q, q, similarity="l1", mask=qkv.causal())
compiled = torch.compile(fn, backend=record, fullgraph=True)(q)
assert "flat_apply" in graphs[-1] and "_traced_call" in graphs[-1], graphs
assert (compiled - fn(q)).abs().max() <= 1e-5
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
