"""The few-row float32 product (qkv.engines.cpu.few_rows) against float64, and qkv.nn.linear's
choice of it: decoding's products, 1 to 16 rows (its bf16 product: test_few_rows_bf16.py)."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import qkv.nn.linear as linear_module
from qkv.engines.cpu import few_rows
from qkv.nn.linear import Linear, linear

from ..nn.conftest import assert_float32_linear, llama_shaped_gpt

pytestmark = pytest.mark.skipif(not few_rows.available(),
                                reason="the few-row loop needs a C compiler with OpenMP")


def _no_f_linear(*args, **kwargs):
    raise AssertionError("F.linear was called")


@pytest.fixture
def only_few_rows(monkeypatch):
    """oneDNN off and F.linear failing loudly: a product that returns took the loop."""
    monkeypatch.setattr(linear_module, "onednn_available", lambda: False)
    monkeypatch.setattr(linear_module, "F", SimpleNamespace(linear=_no_f_linear))


# The products the loop takes: leading dims of up to MAX_ROWS rows, widths and thread counts
# (the bf16 product's test draws the same).
few_row_products = given(
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2).filter(
        lambda dims: torch.Size(dims).numel() <= few_rows.MAX_ROWS),
    n_in=st.integers(1, 70), n_out=st.integers(1, 40), bias=st.booleans(),
    strided=st.booleans(), threads=st.sampled_from([1, 2, 3]))


@settings(max_examples=60, deadline=None)
@few_row_products
def test_the_loop_is_the_linear_map(lead, n_in, n_out, bias, strided, threads):
    # Widths around the vector lanes (8, 16) and output tiles (4, 8) leave ragged tails; a
    # strided x is a slice of wider rows; more threads than output tiles leaves some idle.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(linear_module, "onednn_available", lambda: False)
        mp.setattr(linear_module, "F", SimpleNamespace(linear=_no_f_linear))
        g = torch.Generator().manual_seed(n_in * 131 + n_out)
        x = torch.randn(*lead, n_in + 3 * strided, generator=g)[..., :n_in]
        weight = torch.randn(n_out, n_in, generator=g)
        b = torch.randn(n_out, generator=g) if bias else None
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                y = linear(x, weight, b)
        finally:
            torch.set_num_threads(previous)
        assert y.shape == (*lead, n_out)
        assert_float32_linear(y, x, weight, b)


@pytest.mark.parametrize("product, dtype", [("few_rows_linear", torch.float32),
                                            ("few_rows_linear_bf16", torch.bfloat16)])
def test_a_row_is_the_same_alone_in_any_batch_and_on_any_thread_count(only_few_rows, product,
                                                                     dtype):
    product = getattr(few_rows, product)
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 200, generator=g).to(dtype), torch.randn(300, generator=g)
    x = torch.randn(few_rows.MAX_ROWS, 200, generator=g)
    alone = torch.cat([product(x[i:i + 1], weight, bias) for i in range(len(x))])
    for rows in (2, 3, 7, few_rows.MAX_ROWS):
        assert torch.equal(product(x[:rows], weight, bias), alone[:rows])
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(product(x, weight, bias), alone)
    finally:
        torch.set_num_threads(previous)


def test_non_finite_inputs_give_what_f_linear_gives():
    weight = torch.randn(24, 40)
    x = torch.randn(3, 40)
    x[0, 5], x[1, 17], x[2, 39] = float("nan"), float("inf"), float("-inf")
    weight[3, 17] = 0.0  # inf * 0: NaN in output 3 of row 1
    got = few_rows.few_rows_linear(x, weight)
    want = F.linear(x, weight)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    torch.testing.assert_close(got[finite], want[finite])


@pytest.mark.parametrize("case", ["more rows", "grad", "transposed weight", "float64", "empty"])
def test_other_products_leave_the_loop(monkeypatch, case):
    monkeypatch.setattr(linear_module, "onednn_available", lambda: False)
    monkeypatch.setattr(few_rows, "few_rows_linear", _no_f_linear)
    x, weight = torch.randn(4, 16), torch.randn(8, 16)
    if case == "more rows":
        x = torch.randn(few_rows.MAX_ROWS + 1, 16)
    elif case == "transposed weight":
        weight = torch.randn(16, 8).T
    elif case == "float64":
        x, weight = x.double(), weight.double()
    elif case == "empty":
        x = torch.randn(0, 16)
    if case == "grad":
        x.requires_grad_()
        y = linear(x, weight)
        y.sum().backward()
        torch.testing.assert_close(x.grad, weight.sum(0).expand(4, 16))
    else:
        with torch.no_grad():
            y = linear(x, weight)
    torch.testing.assert_close(y, F.linear(x, weight))


def test_beside_onednn_more_rows_go_to_onednn(monkeypatch):
    monkeypatch.setattr(linear_module, "onednn_available", lambda: True)
    taken, onednn = [], []
    real = few_rows.few_rows_linear
    monkeypatch.setattr(few_rows, "few_rows_linear",
                        lambda *a: taken.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(linear_module, "onednn_linear",
                        lambda x, w, b: onednn.append(x.shape[0]) or F.linear(x, w, b))
    weight = torch.randn(8, 16)
    with torch.no_grad():
        for rows in (few_rows.MAX_ROWS, few_rows.MAX_ROWS + 1):
            linear(torch.randn(rows, 16), weight)
    assert taken == [few_rows.MAX_ROWS] and onednn == [few_rows.MAX_ROWS + 1]


def test_a_gpt_decodes_the_same_with_the_loop_off(monkeypatch):
    model = llama_shaped_gpt()
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_loop = model.generate(idx, 8, temperature=0)
        logits = model(idx[:, :1])
        monkeypatch.setattr(few_rows, "available", lambda: False)
        assert torch.equal(model.generate(idx, 8, temperature=0), with_loop)
        want = model(idx[:, :1])
    assert ((logits - want).abs().max() / want.abs().max()).item() < 1e-5


def test_the_module_runs_the_loop_in_inference(only_few_rows):
    layer = Linear(48, 24)
    x = torch.randn(2, 1, 48)  # one decoding step of two sequences
    with torch.inference_mode():
        assert_float32_linear(layer(x), x, layer.weight, layer.bias)


def assert_switch(variable: str, module: str, on: str, value: str) -> None:
    """In a fresh process (a switch is read once per process), ``variable=value`` turns the C
    code of ``qkv.engines.cpu.<module>`` off (expression ``on`` prints False) for "0", and is
    refused by name for any other value than 0 or 1."""
    code = (f"from qkv.engines.cpu import {module}\n"
            f"try:\n    print({on})\n"
            "except ValueError as err:\n    print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, variable: value}, check=True)
    want = "False" if value == "0" else f"{variable} must be 0, 1 or unset; got {value!r}"
    assert done.stdout.strip() == want


@pytest.mark.parametrize("value", ["0", "yes"])
def test_the_switch_turns_it_off_or_is_refused_by_name(value):
    assert_switch("QKV_FEW_ROWS_LINEAR", "few_rows", "few_rows.available()", value)
