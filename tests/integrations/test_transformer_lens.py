"""qkv inside TransformerLens's bridge: the same logits, caches, pattern writes and gradients
as the bridge's eager default, on tiny models built from configs; layers nobody hooks run
qkv's fused path."""

import pytest
import torch

pytest.importorskip("transformer_lens")

from qkv.engines import api  # noqa: E402
from qkv.integrations.transformer_lens import enable  # noqa: E402

from . import transformer_lens_tiny as tiny  # noqa: E402

PATTERN = "blocks.{}.attn.hook_pattern"


@pytest.fixture(scope="module")
def pair():
    """(eager bridge, qkv bridge) over the same 2-layer LLaMA weights."""
    model = tiny.llama()
    return tiny.bridge(model), enable(tiny.bridge(model))


@pytest.fixture()
def calls(monkeypatch):
    """Each qkv attention call's return_weights (one per layer that runs on qkv)."""
    seen, real = [], api.attention
    monkeypatch.setattr(api, "attention", lambda *a, **kw: seen.append(
        bool(kw.get("return_weights"))) or real(*a, **kw))
    return seen


def tokens(batch=2, n=12, seed=0):
    return torch.randint(3, 50, (batch, n), generator=torch.Generator().manual_seed(seed))


def test_logits_and_caches_match_eager(pair, calls):
    eager, fast = pair
    ids = tokens()
    names = lambda n: n.endswith(("hook_pattern", "hook_z", "hook_resid_post"))  # noqa: E731
    ref, ref_cache = eager.run_with_cache(ids, names_filter=names)
    out, cache = fast.run_with_cache(ids, names_filter=names)
    assert (out - ref).abs().max().item() <= 1e-5
    assert set(cache.keys()) == set(ref_cache.keys()) and len(cache.keys()) == 6
    for name in ref_cache.keys():
        assert (cache[name] - ref_cache[name]).abs().max().item() <= 1e-5, name
    assert calls == [True, True]  # both layers on qkv, each forming its pattern


def test_padded_batch_matches_eager(pair):
    eager, fast = pair
    ids = tokens(3)
    mask = torch.ones_like(ids)
    mask[1, :4] = mask[2, :7] = 0  # left padding
    ref = eager(ids, attention_mask=mask)
    out = fast(ids, attention_mask=mask)
    assert (out - ref)[mask.bool()].abs().max().item() <= 1e-5


def test_unhooked_layers_run_fused(pair, calls):
    eager, fast = pair
    ids = tokens()
    out = fast(ids)
    assert calls == [False, False]
    _, cache = fast.run_with_cache(ids, names_filter=PATTERN.format(1))
    assert calls[2:] == [False, True]  # only the hooked layer forms weights
    assert (out - eager(ids)).abs().max().item() <= 1e-5


def _rewrite(pattern, hook=None):
    """Head 1 attends uniformly over its causal keys; head 0's weights are halved."""
    n = pattern.shape[-1]
    uniform = torch.ones(n, n).tril() / torch.arange(1, n + 1)[:, None]
    out = pattern.clone()
    out[:, 1] = uniform
    out[:, 0] = pattern[:, 0] / 2
    return out


def test_pattern_write_matches_eager(pair, calls):
    eager, fast = pair
    ids = tokens()
    hooks = [(PATTERN.format(0), _rewrite)]
    ref = eager.run_with_hooks(ids, fwd_hooks=hooks)
    out = fast.run_with_hooks(ids, fwd_hooks=hooks)
    assert (out - ref).abs().max().item() <= 1e-5
    assert (out - fast(ids)).abs().max().item() > 1e-3  # the write reached the output
    assert calls[:2] == [True, False]


def test_observing_a_pattern_keeps_the_logits(pair, calls):
    """A read-only hook changes nothing but which engine forms that layer (with weights)."""
    _, fast = pair
    ids = tokens()
    with torch.no_grad():
        base = fast(ids)
        seen = fast.run_with_hooks(ids, fwd_hooks=[(PATTERN.format(0), lambda t, hook: None)])
    assert (seen - base).abs().max().item() <= 1e-6
    assert calls == [False, False, True, False]


def _grads(bridge, ids, write):
    """Gradient of a logit sum w.r.t. layer 0's (retained) pattern and every parameter."""
    kept = {}

    def keep(pattern, hook):
        pattern = _rewrite(pattern) if write else pattern
        pattern.retain_grad()
        kept["p"] = pattern
        return pattern

    bridge.zero_grad(set_to_none=True)
    logits = bridge.run_with_hooks(ids, fwd_hooks=[(PATTERN.format(0), keep)])
    logits[:, -1, :5].sum().backward()
    params = {n: p.grad.clone() for n, p in bridge.named_parameters() if p.grad is not None}
    return kept["p"].grad, params


@pytest.mark.parametrize("write", [False, True])
def test_gradients_through_a_hooked_pattern_match_eager(pair, write):
    eager, fast = pair
    ids = tokens()
    ref_pattern, ref_params = _grads(eager, ids, write)
    pattern, params = _grads(fast, ids, write)
    assert ref_pattern.abs().max() > 0
    assert (pattern - ref_pattern).abs().max().item() <= 1e-5
    assert params.keys() == ref_params.keys() and len(params) > 10
    assert max((params[n] - ref_params[n]).abs().max().item() for n in params) <= 1e-4


def test_pre_softmax_scores_hook_runs_that_layer_on_the_reconstruction(pair, calls):
    eager, fast = pair
    ids = tokens()
    name = "blocks.1.attn.hook_attn_scores"
    _, ref = eager.run_with_cache(ids, names_filter=name)
    _, cache = fast.run_with_cache(ids, names_filter=name)
    finite = ref[name] > torch.finfo(torch.float32).min
    assert torch.equal(finite, cache[name] > torch.finfo(torch.float32).min)
    assert (cache[name] - ref[name])[finite].abs().max().item() <= 1e-5
    assert calls == [False]  # layer 0 on qkv; layer 1 computed its scores in torch


def test_joint_qkv_bridge_on_qkv_masks():
    """GPT-2's bridge reconstructs attention from its split projections; it keeps doing so on
    the dense form of qkv's mask, with eager's logits."""
    model = tiny.gpt2()
    eager, fast = tiny.bridge(model), enable(tiny.bridge(model))
    ids = tokens(3)
    mask = torch.ones_like(ids)
    mask[2, :5] = 0
    ref, out = eager(ids, attention_mask=mask), fast(ids, attention_mask=mask)
    assert (out - ref)[mask.bool()].abs().max().item() <= 1e-5


def test_switching_back_to_eager(pair, calls):
    eager, fast = pair
    ids = tokens()
    fast.original_model.set_attn_implementation("eager")
    try:
        _, cache = fast.run_with_cache(ids, names_filter=PATTERN.format(0))
        _, ref = eager.run_with_cache(ids, names_filter=PATTERN.format(0))
    finally:
        fast.original_model.set_attn_implementation("qkv")
    assert calls == []  # TransformerLens's own attention again
    assert torch.equal(cache[PATTERN.format(0)], ref[PATTERN.format(0)])


def test_errors_name_the_argument(pair):
    _, fast = pair
    with pytest.raises(TypeError, match="bridge"):
        enable(torch.nn.Linear(2, 2))
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    native = TransformerBridge.boot_native(TransformerBridgeConfig(
        d_model=32, d_head=16, n_heads=2, n_layers=1, n_ctx=8, d_vocab=16, d_mlp=64,
        act_fn="gelu", normalization_type="LN", seed=0))
    with pytest.raises(TypeError, match="bridge must be .* over a transformers model; got one "
                                        "over NativeModel"):
        enable(native)
    with pytest.raises(ValueError, match="name"):
        enable(fast, name="eager")
    with pytest.raises(ValueError, match="hook_pattern must return a tensor of shape"):
        fast.run_with_hooks(tokens(), fwd_hooks=[(PATTERN.format(0),
                                                  lambda t, hook: t[..., :-1])])
