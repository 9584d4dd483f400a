"""qkv.nn.linear.shared_input: linear layers of the same input (attention's q, k and v, a
gated MLP's gate and up) in one few-row call, with the same outputs as each layer's own call,
and each layer's own call wherever it has hooks or the loop does not take it."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import qkv.nn.linear as linear_module
from qkv.engines.cpu import few_rows
from qkv.nn.attention import MultiHeadAttention
from qkv.nn.feedforward import GatedMLP
from qkv.nn.linear import Linear, shared_input
from qkv.nn.packed import PackedLinear

pytestmark = pytest.mark.skipif(not few_rows.available(),
                                reason="the few-row loop needs a C compiler with OpenMP")


@pytest.fixture
def group_calls(monkeypatch):
    """The number of weights in each few-row call of more than one."""
    calls = []
    real = few_rows.few_rows_linears
    monkeypatch.setattr(few_rows, "few_rows_linears",
                        lambda x, w, b: (len(w) > 1 and calls.append(len(w))) or real(x, w, b))
    return calls


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, few_rows.MAX_ROWS), n_in=st.integers(1, 70),
       widths=st.lists(st.integers(1, 40), min_size=2, max_size=3),
       biases=st.lists(st.booleans(), min_size=3, max_size=3),
       threads=st.sampled_from([1, 2, 3]), bf16=st.booleans())
def test_each_output_is_the_layers_own(rows, n_in, widths, biases, threads, bf16):
    # Output tiles of one weight end inside another's range of a thread; more threads than
    # tiles leaves some idle. bf16: qkv.nn.packed's layers, where they take the loop.
    torch.manual_seed(rows * 100 + n_in)
    layers = [Linear(n_in, n, bias=b) for n, b in zip(widths, biases, strict=False)]
    if bf16:
        layers = [PackedLinear(layer, torch.bfloat16) for layer in layers]
        if not layers[0].few_row_loop:
            return  # this CPU's bf16 layers go to oneDNN: the group is each layer's call
    x = torch.randn(rows, n_in)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.no_grad():
            got = shared_input(x, tuple(layers))
            want = [layer(x) for layer in layers]
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_attention_and_the_gated_mlp_make_one_call_a_decoding_step(group_calls):
    attn, mlp = MultiHeadAttention(64, 4, n_kv_head=2, bias=False), GatedMLP(64, 96, bias=False)
    x, memory = torch.randn(2, 1, 64), torch.randn(2, 5, 64)
    with torch.no_grad():
        out, hidden = attn(x), mlp(x)
        assert group_calls == [3, 2]
        attn(x, memory)  # a query apart from its keys: k and v together
        assert group_calls == [3, 2, 2]
    torch.testing.assert_close(attn(x), out)  # with gradients: each layer's own call
    torch.testing.assert_close(mlp(x), hidden)
    assert group_calls == [3, 2, 2]


@pytest.mark.parametrize("case", ["a hook", "a global hook", "more rows", "grad",
                                  "mixed dtypes", "another layer"])
def test_otherwise_each_layer_makes_its_own_call(group_calls, case):
    layers = [Linear(16, 8), Linear(16, 8, bias=False)]
    x = torch.randn(2, 16)
    seen, handles = [], []
    if case == "a hook":
        handles.append(layers[1].register_forward_hook(lambda m, i, o: seen.append(o.shape)))
    elif case == "a global hook":
        handles.append(nn.modules.module.register_module_forward_hook(
            lambda m, i, o: seen.append(o.shape)))
    elif case == "more rows":
        x = torch.randn(few_rows.MAX_ROWS + 1, 16)
    elif case == "grad":
        x.requires_grad_()
    elif case == "mixed dtypes":
        layers[1] = PackedLinear(layers[1], torch.bfloat16)
    elif case == "another layer":
        layers[1] = nn.Linear(16, 8)  # torch's own: no few_row_operands
    try:
        with torch.set_grad_enabled(case == "grad"):
            got = shared_input(x, tuple(layers))
            want = [layer(x) for layer in layers]
    finally:
        for handle in handles:
            handle.remove()
    assert group_calls == []
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    if case in ("a hook", "a global hook"):
        assert len(seen) >= 2  # the hooks saw the group's outputs too


def test_more_than_three_weights_are_refused():
    x = torch.randn(1, 8)
    weights = tuple(torch.randn(4, 8) for _ in range(4))
    with pytest.raises(ValueError, match="1 to 3 weights; got 4"):
        few_rows.few_rows_linears(x, weights, (None,) * 4)


def test_the_group_takes_the_loop_only_where_each_layer_would(monkeypatch):
    # The one rule for a layer and for the group: float32_inference and the loop's shapes.
    monkeypatch.setattr(linear_module, "float32_inference", lambda *a: False)
    assert linear_module._few_row_group(torch.randn(1, 16), (Linear(16, 8), Linear(16, 8))) \
        is None
