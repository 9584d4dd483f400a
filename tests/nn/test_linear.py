"""qkv.nn.Linear: nn.Linear's numbers through oneDNN where that is faster, and F.linear
wherever the oneDNN product does not apply (autograd, compile, autocast, other dtypes). The
few-row loop that takes decoding's products first is tested in tests/core/test_few_rows.py;
here it is off, so that each test sees the path it names (the width check, which both fast
paths share, turns it back on)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qkv.nn.linear as linear_module
from qkv.engines.cpu import few_rows
from qkv.nn.linear import Linear, linear

from .conftest import assert_float32_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch is built without oneDNN")


@pytest.fixture(autouse=True)
def without_few_rows(monkeypatch):
    monkeypatch.setattr(linear_module.few_rows, "available", lambda: False)


@pytest.fixture
def onednn(monkeypatch):
    """The oneDNN product forced on, and F.linear made to fail loudly: a call that passes
    took the oneDNN path."""
    monkeypatch.setattr(linear_module, "onednn_available", lambda: True)
    monkeypatch.setattr(linear_module, "F", _NO_F_LINEAR)


def _no_f_linear(*args, **kwargs):
    raise AssertionError("F.linear was called")


# Stands in for torch.nn.functional inside qkv.nn.linear only.
_NO_F_LINEAR = SimpleNamespace(linear=_no_f_linear)


@needs_onednn
@settings(max_examples=30, deadline=None)
@given(lead=st.lists(st.integers(0, 5), max_size=3), n_in=st.integers(1, 70),
       n_out=st.integers(1, 70), bias=st.booleans(), transposed=st.booleans())
def test_onednn_product_is_the_linear_map(lead, n_in, n_out, bias, transposed):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_module.few_rows, "available", lambda: False)
        mp.setattr(linear_module, "onednn_available", lambda: True)
        mp.setattr(linear_module, "F", _NO_F_LINEAR)
        g = torch.Generator().manual_seed(n_in * 97 + n_out)
        x = torch.randn(*lead, n_in, generator=g)
        if transposed and len(lead) >= 1:  # a non-contiguous input
            x = torch.randn(n_in, *lead, generator=g).movedim(0, -1)
        weight = torch.randn(n_out, n_in, generator=g)
        b = torch.randn(n_out, generator=g) if bias else None
        assert_float32_linear(linear(x, weight, b), x, weight, b)


@needs_onednn
def test_linear_module_takes_the_onednn_path_in_inference(onednn):
    layer = Linear(48, 24)
    x = torch.randn(3, 5, 48)
    with torch.no_grad():
        y = layer(x)
    assert_float32_linear(y, x, layer.weight, layer.bias)
    with torch.inference_mode():
        assert_float32_linear(layer(x), x, layer.weight, layer.bias)


@pytest.mark.parametrize("case", ["grad", "float64", "autocast", "onednn off"])
def test_f_linear_serves_what_onednn_does_not(monkeypatch, case):
    monkeypatch.setattr(linear_module, "onednn_available", lambda: case != "onednn off")
    calls = []
    real = F.linear
    monkeypatch.setattr(linear_module, "F", SimpleNamespace(
        linear=lambda *a, **k: calls.append(1) or real(*a, **k)))
    layer = Linear(16, 8)
    x = torch.randn(4, 16)
    if case == "grad":
        x.requires_grad_()
        y = layer(x)
        y.sum().backward()  # autograd through F.linear
        # d sum(x W^T + b) in float64: dW = 1^T x, db = the row count, dx = 1 W
        ones = torch.ones(4, 8, dtype=torch.float64)
        torch.testing.assert_close(layer.weight.grad, (ones.T @ x.detach().double()).float())
        torch.testing.assert_close(layer.bias.grad, ones.sum(0).float())
        torch.testing.assert_close(x.grad, (ones @ layer.weight.detach().double()).float())
    elif case == "float64":
        layer = layer.double()
        with torch.no_grad():
            y = layer(x.double())
        assert y.dtype == torch.float64
    elif case == "autocast":
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            y = layer(x)
        assert y.dtype == torch.bfloat16  # autocast saw the product
    else:
        with torch.no_grad():
            y = layer(x)
        assert torch.equal(y, real(x, layer.weight, layer.bias))
    assert calls == [1]


def test_linear_is_an_nn_linear_with_its_state_dict():
    torch.manual_seed(0)
    plain = nn.Linear(12, 7)
    ours = Linear(12, 7)
    assert isinstance(ours, nn.Linear)
    ours.load_state_dict(plain.state_dict())
    assert ours.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(2, 12)
    with torch.no_grad():
        assert_float32_linear(ours(x), x, plain.weight, plain.bias)


@needs_onednn
def test_compile_and_export_leave_the_product_to_the_compiler(monkeypatch):
    monkeypatch.setattr(linear_module, "onednn_available", lambda: True)
    torch._dynamo.reset()
    layer = Linear(32, 16)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    x = torch.randn(5, 32)
    with torch.no_grad():
        want, got = layer(x), compiled(x)
    assert_float32_linear(got, x, layer.weight, layer.bias)
    assert_float32_linear(want, x, layer.weight, layer.bias)
    with torch.no_grad():
        exported = torch.export.export(layer, (x,))
    calls = [n.target for n in exported.graph.nodes if n.op == "call_function"]
    assert calls == [torch.ops.aten.linear.default]  # portable: no oneDNN op in the graph


def test_the_forcing_variable_is_checked(monkeypatch):
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch is built without oneDNN: the variable is never read")
    linear_module.onednn_available.cache_clear()
    try:
        monkeypatch.setenv("QKV_ONEDNN_LINEAR", "yes")
        with pytest.raises(ValueError, match="QKV_ONEDNN_LINEAR must be 0, 1 or unset"):
            linear_module.onednn_available()
        monkeypatch.setenv("QKV_ONEDNN_LINEAR", "0")
        linear_module.onednn_available.cache_clear()
        assert linear_module.onednn_available() is False
        monkeypatch.setenv("QKV_ONEDNN_LINEAR", "1")
        linear_module.onednn_available.cache_clear()
        assert linear_module.onednn_available() is True
    finally:
        linear_module.onednn_available.cache_clear()


@needs_onednn
def test_a_gpt_generates_the_same_through_either_product(monkeypatch, small_gpt):
    model, idx = small_gpt
    monkeypatch.setattr(linear_module, "onednn_available", lambda: False)
    with torch.no_grad():
        want = model(idx)
        greedy = model.generate(idx, 8, temperature=0)
    monkeypatch.setattr(linear_module, "onednn_available", lambda: True)
    with torch.no_grad():
        got = model(idx)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert torch.equal(model.generate(idx, 8, temperature=0), greedy)


@pytest.mark.parametrize("path", ["few rows", pytest.param("oneDNN", marks=needs_onednn)])
@pytest.mark.parametrize("x_width, bias_width", [(15, None), (17, 8), (16, 7), (16, 9)])
def test_mismatched_widths_get_f_linear_s_error(monkeypatch, path, x_width, bias_width):
    """Neither fast path takes operands whose widths disagree: oneDNN's error would say only
    that a primitive failed, and the few-row loop would read past them."""
    if path == "few rows":
        monkeypatch.undo()  # the loop back on (the autouse fixture turned it off), beside MKL
        if not few_rows.available():
            pytest.skip("the few-row loop needs a C compiler with OpenMP")
        monkeypatch.setattr(linear_module, "onednn_available", lambda: False)
    else:
        monkeypatch.setattr(linear_module, "onednn_available", lambda: True)
    weight = torch.randn(8, 16)
    bias = None if bias_width is None else torch.randn(bias_width)
    x = torch.randn(2 if path == "few rows" else 20, x_width)
    with torch.no_grad():
        with pytest.raises(RuntimeError) as got:
            linear(x, weight, bias)
        with pytest.raises(RuntimeError) as want:
            F.linear(x, weight, bias)
    assert str(got.value) == str(want.value)
