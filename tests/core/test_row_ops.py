"""RMSNorm and RoPE's rotation of a few rows in C (qkv.engines.cpu.row_ops) against float64,
and the modules' choice of them: decoding's small operations, 1 to 16 rows."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.engines.cpu import few_rows, row_ops
from qkv.nn.norms import RMSNorm
from qkv.nn.positions import RotaryEmbedding, Rotation, last_positions

from ..nn.conftest import llama_shaped_gpt
from .test_few_rows import assert_switch

pytestmark = pytest.mark.skipif(row_ops._library() is None,
                                reason="the row operations need a C compiler")

U = 2.0 ** -24  # float32's unit roundoff


def _rms_norm64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 4), min_size=0, max_size=2).filter(
           lambda dims: torch.Size(dims).numel() <= few_rows.MAX_ROWS),
       d=st.integers(1, 70), eps=st.sampled_from([1e-6, 1e-5, 0.5]), sliced=st.booleans())
def test_rms_norm_is_the_float64_norm(lead, d, eps, sliced):
    # Widths around the vector lanes leave ragged tails; a sliced x is the last positions of
    # longer rows, as a model's last block hands its final norm.
    g = torch.Generator().manual_seed(d * 7 + len(lead))
    x = torch.randn(*lead, d, generator=g) * 3
    if sliced and x.dim() == 3:
        x = torch.randn(lead[0], lead[1] + 2, d, generator=g)[:, -lead[1]:]
    weight = torch.randn(d, generator=g)
    with torch.no_grad():
        got = row_ops.rms_norm(x, weight, eps)
    assert got is not None and got.shape == x.shape and got.is_contiguous()
    want = _rms_norm64(x, weight, eps)
    # A sum of d squares, a division, a square root and two products, each in float32.
    bound = (d + 8) * U * (x.double().abs() * torch.rsqrt(
        x.double().pow(2).mean(-1, keepdim=True) + eps) * weight.double().abs())
    assert ((got.double() - want).abs() <= bound + 1e-30).all()
    torch.testing.assert_close(got, F.rms_norm(x, (d,), weight, eps), rtol=1e-5, atol=1e-6)


def _rotate64(x, cos, sin):
    x = x.double()
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos.double() + swapped * sin.double()


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 4), h=st.integers(1, 9), n=st.integers(1, 4),
       half=st.integers(1, 40), per_row=st.booleans(), last=st.booleans())
def test_rotation_is_the_float64_rotation(b, h, n, half, per_row, last):
    # x is a model's split heads: (B, N, H, D) memory seen as (B, H, N, D). Positions are
    # shared (N,) or per row (B, N, left padding); ``last`` takes the queries' last position
    # of a longer rotation, a slice.
    if b * n > few_rows.MAX_ROWS:
        n = 1
    d = 2 * half
    g = torch.Generator().manual_seed(b * 1000 + h * 100 + n * 10 + half)
    x = torch.randn(b, n, h, d, generator=g).transpose(1, 2)
    rope = RotaryEmbedding(d)
    positions = torch.randint(0, 4096, (b, n + 1) if per_row else (n + 1,), generator=g)
    rotation = rope.rotation(positions)
    rotation = last_positions(rotation, n) if last else Rotation(
        rotation.cos[..., :n, :], rotation.sin[..., :n, :])
    with torch.no_grad():
        got = row_ops.rotate(x, rotation.cos, rotation.sin)
    assert got is not None and got.shape == x.shape and got.is_contiguous()
    want = _rotate64(x, rotation.cos, rotation.sin)
    # Two products and a sum in float32 (one of them fused, or not).
    bound = 3 * U * (x.double().abs() * rotation.cos.double().abs()
                     + torch.cat((x[..., half:], x[..., :half]), -1).double().abs()
                     * rotation.sin.double().abs())
    assert ((got.double() - want).abs() <= bound + 1e-30).all()


def test_a_row_is_the_same_alone_in_any_batch():
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(few_rows.MAX_ROWS, 1, 576, generator=g), torch.randn(576)
    rope = RotaryEmbedding(64)
    heads = torch.randn(few_rows.MAX_ROWS, 9, 1, 64, generator=g)
    rotation = rope.rotation(torch.arange(100, 100 + few_rows.MAX_ROWS)[:, None])
    with torch.no_grad():
        norm_alone = torch.cat([row_ops.rms_norm(x[i:i + 1], weight, 1e-5)
                                for i in range(len(x))])
        rotated_alone = torch.cat([row_ops.rotate(heads[i:i + 1], rotation.cos[i:i + 1],
                                                  rotation.sin[i:i + 1])
                                   for i in range(len(x))])
        for rows in (2, 5, few_rows.MAX_ROWS):
            assert torch.equal(row_ops.rms_norm(x[:rows], weight, 1e-5), norm_alone[:rows])
            assert torch.equal(row_ops.rotate(heads[:rows], rotation.cos[:rows],
                                              rotation.sin[:rows]), rotated_alone[:rows])


def test_non_finite_inputs_give_what_torch_gives():
    x = torch.randn(4, 32)
    x[0, 3], x[1, 7], x[2, 0] = float("nan"), float("inf"), float("-inf")
    weight = torch.randn(32)
    with torch.no_grad():
        got = row_ops.rms_norm(x, weight, 1e-5)
    want = F.rms_norm(x, (32,), weight, 1e-5)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf())
    torch.testing.assert_close(got[3], want[3])


@pytest.mark.parametrize("case", ["more rows", "grad", "float64", "empty", "strided rows"])
def test_other_norms_stay_in_torch(case):
    x, weight = torch.randn(4, 16), torch.randn(16)
    if case == "more rows":
        x = torch.randn(few_rows.MAX_ROWS + 1, 16)
    elif case == "float64":
        x, weight = x.double(), weight.double()
    elif case == "empty":
        x = torch.randn(0, 16)
    elif case == "strided rows":
        x = torch.randn(16, 4).T  # unit stride across rows, not along them
    if case == "grad":
        weight.requires_grad_()
        assert row_ops.rms_norm(x, weight, 1e-5) is None
    else:
        with torch.no_grad():
            assert row_ops.rms_norm(x, weight, 1e-5) is None


@pytest.mark.parametrize("case", ["more positions", "grad", "float64", "odd width",
                                  "strided width"])
def test_other_rotations_stay_in_torch(case):
    n = few_rows.MAX_ROWS + 1 if case == "more positions" else 2
    d = 7 if case == "odd width" else 8
    x = torch.randn(1, 3, n, d)
    cos, sin = torch.randn(n, d), torch.randn(n, d)
    if case == "float64":
        x, cos, sin = x.double(), cos.double(), sin.double()
    elif case == "strided width":
        x = torch.randn(1, 3, n, 2 * d)[..., ::2]
    if case == "grad":
        x.requires_grad_()
        assert row_ops.rotate(x, cos, sin) is None
    else:
        with torch.no_grad():
            assert row_ops.rotate(x, cos, sin) is None


def test_the_modules_take_them_in_inference_only(monkeypatch):
    taken = []
    for name in ("rms_norm", "rotate"):
        real = getattr(row_ops, name)

        def counted(*args, _real=real, _name=name):
            result = _real(*args)
            taken.append((_name, result is not None))
            return result

        monkeypatch.setattr(row_ops, name, counted)
    norm, rope = RMSNorm(64), RotaryEmbedding(16)
    x, heads = torch.randn(2, 1, 64), torch.randn(2, 4, 1, 16)
    positions = torch.tensor([5])
    with torch.no_grad():
        y, r = norm(x), rope(heads, positions)
    # The norm's weight is a parameter, which the C operation reads as it is.
    assert taken == [("rms_norm", True), ("rotate", True)]
    torch.testing.assert_close(y, F.rms_norm(x, (64,), norm.weight, norm.eps))
    monkeypatch.setattr(row_ops, "_library", lambda: None)  # torch's own operations
    with torch.no_grad():
        torch.testing.assert_close(r, rope(heads, positions), rtol=1e-6, atol=1e-6)
    # With gradients they stay in torch's operations, which autograd records.
    y = norm(x)
    assert y.grad_fn is not None


def test_a_gpt_decodes_the_same_with_them_off(monkeypatch):
    model = llama_shaped_gpt()
    idx = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_ops = model.generate(idx, 8, temperature=0)
        cache = model.new_cache(2, 16)
        model(idx[:, :11], cache=cache)
        logits = model(idx[:, 11:], cache=cache)
        monkeypatch.setattr(row_ops, "_library", lambda: None)
        assert torch.equal(model.generate(idx, 8, temperature=0), with_ops)
        cache = model.new_cache(2, 16)
        model(idx[:, :11], cache=cache)
        want = model(idx[:, 11:], cache=cache)
    assert ((logits - want).abs().max() / want.abs().max()).item() < 1e-5


@pytest.mark.parametrize("value", ["0", "yes"])
def test_the_switch_turns_them_off_or_is_refused_by_name(value):
    assert_switch("QKV_ROW_OPS", "row_ops", "row_ops._library() is not None", value)
