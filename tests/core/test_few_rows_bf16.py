"""The few-row product with a bf16 weight (few_rows.few_rows_linear_bf16), as qkv.nn.packed's
bf16 layers compute it: x rounded to bf16, float32 sums, each output rounded to bf16, then the
float32 bias. Against float64, torch's own bf16 product, and the build without AVX512-BF16
(a row's independence of its batch and of the thread count: test_few_rows.py)."""

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import settings
from torch import nn

import qkv.nn.packed as packed_module
from qkv.engines.cpu import few_rows
from qkv.nn.packed import PackedLinear

from .test_few_rows import few_row_products

pytestmark = pytest.mark.skipif(not few_rows.available(),
                                reason="the few-row loop needs a C compiler with OpenMP")
BF16 = torch.bfloat16


def assert_bf16_product(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """y (no bias) is x rounded to bf16 times the bf16 weight, summed in float32 and rounded
    to bf16: each value a bf16, within half a bf16 step of the float64 product plus float32's
    error on the sum of |terms|."""
    assert y.dtype == torch.float32 and y.shape == (*x.shape[:-1], weight.shape[0])
    assert torch.equal(y.to(BF16).float(), y)
    xb, wd = x.to(BF16).double(), weight.double()
    exact, magnitude = xb @ wd.T, xb.abs() @ wd.abs().T
    assert ((y.double() - exact).abs() <= 2**-8 * exact.abs() + 2e-5 * magnitude).all()


@settings(max_examples=60, deadline=None)
@few_row_products
def test_the_loop_is_the_bf16_linear_map(lead, n_in, n_out, bias, strided, threads):
    # Widths around the 32 pairs of a dot-product vector and the 16 or 8 lanes of a widened
    # one leave ragged tails; a strided x is a slice of wider rows (2-D only, as the callers).
    g = torch.Generator().manual_seed(n_in * 131 + n_out)
    x = torch.randn(*lead, n_in + 3 * strided, generator=g)[..., :n_in]
    if x.dim() != 2:
        x = x.contiguous()
    weight = torch.randn(n_out, n_in, generator=g).to(BF16)
    b = torch.randn(n_out, generator=g) if bias else None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        plain = few_rows.few_rows_linear_bf16(x, weight)
        with_bias = few_rows.few_rows_linear_bf16(x, weight, b)
    finally:
        torch.set_num_threads(previous)
    assert_bf16_product(plain, x, weight)
    assert torch.equal(with_bias, plain if b is None else plain + b)


def test_it_gives_torch_s_bf16_product_to_a_bf16_step():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 576, generator=g), torch.randn(300, 576, generator=g).to(BF16)
    got = few_rows.few_rows_linear_bf16(x, weight)
    torch_s = F.linear(x.to(BF16), weight).float()  # float32 sums, rounded to bf16
    assert ((got - torch_s).abs() <= 2**-7 * torch_s.abs()).all()
    assert (got == torch_s).float().mean() > 0.9  # the sums' order moves a few roundings


def test_non_finite_inputs_give_what_torch_s_bf16_product_gives():
    weight = torch.randn(24, 40).to(BF16)
    x = torch.randn(4, 40)
    x[0, 3], x[1, 7], x[2, 0], x[3, 5] = float("nan"), float("inf"), -float("inf"), 3.4e38
    got = few_rows.few_rows_linear_bf16(x, weight)
    want = F.linear(x.to(BF16), weight).float()  # 3.4e38 rounds to bf16's infinity
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    finite = want.isfinite()
    assert ((got - want)[finite].abs() <= 2**-7 * want[finite].abs()).all()


def test_a_bf16_packed_layer_takes_the_loop_for_few_rows_only(monkeypatch):
    # On a CPU without AVX512-BF16 the widened loop runs here: the same product.
    monkeypatch.setattr(few_rows, "bf16_dot_products", lambda: True)
    taken = []
    real = few_rows.few_rows_linear_bf16
    monkeypatch.setattr(few_rows, "few_rows_linear_bf16",
                        lambda *a: taken.append(a[0].shape[:-1].numel()) or real(*a))
    layer = nn.Linear(96, 40, bias=False)
    packed = PackedLinear(layer)
    assert packed.few_row_loop and "oneDNN-packed" not in repr(packed)
    with torch.no_grad():
        for rows in (1, few_rows.MAX_ROWS, few_rows.MAX_ROWS + 1):
            x = torch.randn(rows, 96)
            y = packed(x)
            assert_bf16_product(y, x, layer.weight.detach().to(BF16))
    assert taken == [1, few_rows.MAX_ROWS]


@pytest.mark.parametrize("built, dot_products, onednn_bf16, loop", [
    (False, False, True, False), (False, False, False, False),
    (True, True, True, True), (True, False, False, True),
    # Widened, the loop loses to oneDNN's bf16 product from 4 rows on: oneDNN keeps them.
    (True, False, True, False)])
def test_a_bf16_layer_takes_the_loop_where_it_wins(monkeypatch, built, dot_products,
                                                   onednn_bf16, loop):
    if onednn_bf16 and not loop and not packed_module._onednn_ok(torch.device("cpu")):
        pytest.skip("this CPU's oneDNN cannot pack a bf16 weight")
    monkeypatch.setattr(few_rows, "available", lambda: built)
    monkeypatch.setattr(few_rows, "bf16_dot_products", lambda: dot_products)
    monkeypatch.setattr(packed_module, "_onednn_ok", lambda device: onednn_bf16)
    packed = PackedLinear(nn.Linear(96, 40), torch.bfloat16)
    assert packed.few_row_loop == loop and packed.packed == (onednn_bf16 and not loop)


_AVX2 = """
import json, sys, torch
from qkv.engines.cpu import few_rows
g = torch.Generator().manual_seed(2)
x = torch.randn(3, 101, generator=g)
w = torch.randn(37, 101, generator=g).to(torch.bfloat16)
print(json.dumps({"available": few_rows.available(),
                  "y": few_rows.few_rows_linear_bf16(x, w).tolist()}))
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="an x86-64 target")
def test_the_build_without_avx512_bf16_widens_the_weight_to_the_same_product(tmp_path):
    done = subprocess.run([sys.executable, "-c", _AVX2], capture_output=True, text=True,
                          check=True, env={**os.environ, "QKV_MARCH": "x86-64-v3",
                                           "QKV_CACHE": str(tmp_path)})
    result = json.loads(done.stdout)
    assert result["available"]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 101, generator=g)
    w = torch.randn(37, 101, generator=g).to(BF16)
    assert_bf16_product(torch.tensor(result["y"]), x, w)
