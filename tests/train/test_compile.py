"""``train.compile=true`` trains every attention variant on the same engine as eager mode:
the same losses, step for step, in one compiled graph per shape."""

import functools

import pytest
import torch

from qkv.cli import main

from ..versions import ONE_GRAPH
from .conftest import losses, tiny_lm

# Similarities, position schemes that are score modifiers (ALiBi, T5's relative bias) and a
# sliding-window mask, each on a causal LM; mahalanobis brings a learned metric.
VARIANTS = {
    "l1": ["model.block.similarity=l1"],
    "l2_alibi": ["model.block.similarity=l2", "model.positions.kind=alibi"],
    "cosine_relative": ["model.block.similarity=cosine", "model.positions.kind=relative"],
    "mahalanobis_window": ["model.block.similarity=mahalanobis", "model.window=3"],
    "dot_alibi_window": ["model.positions.kind=alibi", "model.window=5"],
}


@pytest.fixture
def compile_counter(monkeypatch):
    """``torch.compile`` as the trainer calls it, on the aot_eager backend (inductor needs
    minutes per graph on two cores) and with fullgraph=True, so that any graph break fails
    (on torch 2.11, which breaks the graph around qkv.attention, without: tests/versions.py)."""
    compiled = []
    original = torch.compile

    def fullgraph_compile(model, **kwargs):
        compiled.append(model)
        return original(model, backend="aot_eager", fullgraph=ONE_GRAPH, **kwargs)

    monkeypatch.setattr(torch, "compile", fullgraph_compile)
    torch._dynamo.reset()
    return compiled


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_training_matches_eager(tmp_path, compile_counter, variant):
    settings = [arg for s in VARIANTS[variant] for arg in ("--set", s)]
    assert main(tiny_lm(tmp_path / "eager", 4, *settings)) == 0
    assert main(tiny_lm(tmp_path / "compiled", 4, *settings, "--set", "train.compile=true")) == 0
    assert len(compile_counter) == 1
    eager, compiled = losses(tmp_path / "eager"), losses(tmp_path / "compiled")
    assert [s for s, _, _ in eager] == [s for s, _, _ in compiled]
    for (_, a, _), (_, b, _) in zip(eager, compiled, strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(a)), (eager, compiled)


def test_compile_fixture_really_compiles_fullgraph():
    """The fixture's fullgraph=True is what makes a graph break fail the tests above."""
    def breaks(x):
        torch._dynamo.graph_break()
        return x + 1

    compile_ = functools.partial(torch.compile, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="graph_break"):
        compile_(breaks)(torch.ones(1))
