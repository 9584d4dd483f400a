"""GPT: Hugging Face GPT-2 parity, loading errors, cached decoding, sampling and beam search."""

import dataclasses
import itertools
import json

import pytest
import torch

import qkv
from qkv.models import GPT, GPTConfig
from qkv.models.generation import filter_logits

from ..versions import ONE_GRAPH

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=61, n_positions=24, n_embd=24, n_layer=2, n_head=3, bos_token_id=0,
        eos_token_id=0,
    )
    model = transformers.GPT2LMHeadModel(cfg).eval()
    path = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(path)
    return path, model


def test_from_pretrained_matches_hugging_face(hf_dir):
    path, hf = hf_dir
    ours = GPT.from_pretrained(path).eval()
    idx = torch.randint(0, 61, (3, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (ours(idx) - hf(idx).logits).abs().max().item()
    assert diff < 1e-4
    assert ours.config.block.ffn == "gelu_tanh" and ours.config.block_size == 24


def test_greedy_generation_matches_hugging_face(hf_dir):
    path, hf = hf_dir
    ours = GPT.from_pretrained(path)
    idx = torch.randint(1, 61, (1, 5), generator=torch.Generator().manual_seed(2))
    ref = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=8,
                      do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(idx, 8, temperature=0), ref)


def _copy_dir(src, dst, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_from_pretrained_bad_inputs(hf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = hf_dir
    pickled = _copy_dir(path, tmp_path / "pickle", skip=("model.safetensors",))
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match="pickle"):
        GPT.from_pretrained(pickled)
    with pytest.raises(ValueError, match="pickle"):
        GPT.from_pretrained(pickled / "pytorch_model.bin")
    no_config = _copy_dir(path, tmp_path / "noconfig", skip=("config.json",))
    with pytest.raises(ValueError, match="config.json"):
        GPT.from_pretrained(no_config)
    tensors = load_file(str(path / "model.safetensors"))
    missing = _copy_dir(path, tmp_path / "missing")
    save_file({k: v for k, v in tensors.items() if "h.1.mlp.c_fc.bias" not in k},
              str(missing / "model.safetensors"))
    with pytest.raises(ValueError, match=r"h\.1\.mlp\.c_fc\.bias"):
        GPT.from_pretrained(missing)
    mismatched = _copy_dir(path, tmp_path / "mismatched")
    config = json.loads((path / "config.json").read_text())
    (mismatched / "config.json").write_text(json.dumps({**config, "n_inner": 50}))
    with pytest.raises(ValueError, match=r"c_fc\.weight.*shape"):
        GPT.from_pretrained(mismatched)
    (mismatched / "config.json").write_text(json.dumps({**config, "model_type": "t5"}))
    with pytest.raises(ValueError, match="gpt2"):
        GPT.from_pretrained(mismatched)


def tiny(positions="learned", block=None, **kw):
    torch.manual_seed(0)
    block = {"n_head": 4, "d_model": 16, "n_kv_head": 2, **(block or {})}
    return GPT(GPTConfig(vocab_size=37, block_size=20, n_layer=2, block=block,
                         positions={"kind": positions}, **kw)).eval()


def peaked(model):
    """Spread the logits of a freshly initialized model, so that greedy and beam choices have
    no near-ties that rounding differences between equal computations could flip."""
    with torch.no_grad():
        model.lm_head.weight.mul_(20)
    return model


@pytest.mark.parametrize("positions, extra", [
    ("learned", {}), ("sinusoidal", {}), ("rope", {"block": {"similarity": "cosine"}}),
    ("alibi", {"window": 3}), ("relative", {}),
])
def test_cached_logits_equal_uncached_at_every_step(positions, extra):
    model = tiny(positions, **extra)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(1, 37, (3, 12), generator=g)
    left_pad = torch.tensor([0, 4, 2])
    seq[1, :4], seq[2, :2] = 0, 0
    with torch.no_grad():
        full = model(seq, left_pad=left_pad)
        cache = model.new_cache(3, 12)
        steps = [model(seq[:, :5], left_pad=left_pad, cache=cache)]
        steps += [model(seq[:, i:i + 1], left_pad=left_pad, cache=cache) for i in range(5, 12)]
    cached = torch.cat(steps, 1)
    assert (cached - full).abs().max() < 1e-5
    # rows with left padding give the same logits as the unpadded sequence alone
    alone = model(seq[1:2, 4:])
    assert (full[1:2, 4:] - alone).abs().max() < 1e-5


def test_batched_padded_generation_equals_one_by_one():
    model = peaked(tiny("rope"))
    idx = torch.randint(1, 37, (3, 6), generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([6, 2, 4])
    out = model.generate(idx, 5, temperature=0, lengths=lengths, pad_id=0)
    assert out.shape == (3, 11)
    for i, n in enumerate(lengths.tolist()):
        alone = model.generate(idx[i:i + 1, :n], 5, temperature=0)
        assert torch.equal(out[i, :n + 5], alone[0])
        assert (out[i, n + 5:] == 0).all()
    uncached = model.generate(idx, 5, temperature=0, lengths=lengths, use_cache=False)
    assert torch.equal(out, uncached)


def test_beam_search_with_a_wide_beam_is_exhaustive():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=4, block_size=8, n_layer=1, block={"n_head": 2, "d_model": 8})
    model = peaked(GPT(config).eval())
    prompt = torch.tensor([[1, 2]])
    with torch.no_grad():
        def score(cont):
            seq = torch.cat((prompt, torch.tensor([cont])), 1)
            logp = model(seq).log_softmax(-1)[0, 1:-1]
            return logp.gather(1, seq[0, 2:, None]).sum().item()

        best = max(itertools.product(range(4), repeat=3), key=score)
    out = model.generate(prompt, 3, beam_size=16, length_penalty=0.0)
    assert out[0, 2:].tolist() == list(best)
    assert torch.equal(model.generate(prompt, 3, beam_size=1, temperature=0),
                       model.generate(prompt, 3, temperature=0))


def test_beam_search_with_eos_and_batch():
    model = peaked(tiny())
    idx = torch.randint(1, 37, (2, 4), generator=torch.Generator().manual_seed(5))
    out = model.generate(idx, 6, beam_size=3, eos_id=5, length_penalty=0.6,
                         lengths=torch.tensor([4, 3]))
    assert out.shape[0] == 2 and out.shape[1] <= 10
    cached = model.generate(idx, 6, beam_size=3, eos_id=5, use_cache=False, length_penalty=0.6,
                            lengths=torch.tensor([4, 3]))
    assert torch.equal(out, cached)


def test_sampling_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_logits(logits, top_k=2)).tolist() == [[True, False, False, True]]
    p = logits.softmax(-1)[0]  # 0.09, 0.66, 0.24, 0.03
    assert p[1] < 0.7 < p[1] + p[2]
    kept = ~torch.isinf(filter_logits(logits, top_p=0.7))
    assert kept.tolist() == [[False, True, True, False]]
    model = tiny()
    g = torch.Generator().manual_seed(0)
    out = model.generate(torch.tensor([[1, 2]]), 10, top_k=1, generator=g)
    assert torch.equal(out, model.generate(torch.tensor([[1, 2]]), 10, temperature=0))
    sampled = model.generate(torch.tensor([[1, 2]] * 4), 6, temperature=1.5, top_p=0.9, generator=g)
    assert sampled.shape == (4, 8) and sampled.max() < 37


def test_config_round_trips_and_bad_input():
    model = tiny("rope", block={"norm": "rmsnorm", "ffn": "swiglu"}, tie_embeddings=False)
    config = GPTConfig(**json.loads(json.dumps(dataclasses.asdict(model.config))))
    assert config == model.config
    again = GPT(config)
    again.load_state_dict(model.state_dict())
    assert torch.equal(again.eval()(torch.tensor([[1, 2, 3]])), model(torch.tensor([[1, 2, 3]])))
    with pytest.raises(ValueError, match="max_len=20"):
        tiny()(torch.zeros(1, 21, dtype=torch.long))
    with pytest.raises(ValueError, match="max_len=20"):
        tiny().generate(torch.zeros(1, 10, dtype=torch.long), 11)
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1, block={"n_head": 3, "d_model": 16})
    with pytest.raises(ValueError, match="divisible by n_kv_head"):
        GPTConfig(vocab_size=10, block_size=8, n_layer=1,
                  block={"n_head": 4, "d_model": 16, "n_kv_head": 3})
    with pytest.raises(ValueError, match="idx"):
        tiny()(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"lengths must lie in \[1, 3\]"):
        tiny().generate(torch.ones(2, 3, dtype=torch.long), 2, lengths=torch.tensor([3, 4]))


def test_training_lowers_the_loss():
    torch.manual_seed(0)
    block = {"n_head": 2, "d_model": 16, "dropout": 0.1, "norm": "rmsnorm", "ffn": "swiglu"}
    model = GPT(GPTConfig(vocab_size=12, block_size=16, n_layer=2, block=block,
                          positions={"kind": "rope"}))
    seq = torch.arange(16).remainder(12).unsqueeze(0).repeat(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        logits = model(seq[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), seq[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_attention_layers_are_reachable():
    model = tiny()
    from qkv.nn import MultiHeadAttention

    named = [(n, m) for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)]
    assert [n for n, _ in named] == ["blocks.0.self_attn", "blocks.1.self_attn"]
    layers = [m for _, m in named]
    assert not any(m.is_cross for m in layers)


def test_torch_compile_matches_eager():
    # One graph, no breaks (fullgraph=True). aot_eager traces through dynamo and AOTAutograd as
    # inductor does, without its C++ code generation, which takes minutes on 2 shared cores.
    model = tiny()
    idx = torch.randint(1, 37, (2, 8), generator=torch.Generator().manual_seed(6))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        assert (compiled(idx) - model(idx)).abs().max() < 1e-5


def _variant_gpt(similarity="dot", positions="learned"):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=37, block_size=16, n_layer=2,
                         block={"n_head": 2, "d_model": 16, "similarity": similarity},
                         positions={"kind": positions})).eval()


@pytest.mark.parametrize("variant", [{"similarity": "l1"}, {"positions": "alibi"}],
                         ids=["l1", "alibi"])
def test_torch_export_keeps_the_fused_engine_and_matches_eager(variant):
    model = _variant_gpt(**variant)
    idx = torch.randint(1, 37, (2, 12), generator=torch.Generator().manual_seed(7))
    length = torch.export.Dim("length", min=2, max=16)
    program = torch.export.export(model, (idx,), dynamic_shapes=({1: length},))
    ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count("qkv.fused_cpu_forward.default") == 2  # one per layer, no reference
    shorter = idx[:, :7]
    with torch.no_grad():
        for x in (idx, shorter):
            assert (program.module()(x) - model(x)).abs().max() <= 1e-5


@pytest.mark.slow
def test_compiled_training_step_on_the_default_backend_matches_eager():
    """Inductor, as users run it (over a minute of compiling on two cores): forward and
    backward of an L1 GPT with ALiBi, against eager."""
    model = _variant_gpt(similarity="l1", positions="alibi").train()
    idx = torch.randint(1, 37, (2, 16), generator=torch.Generator().manual_seed(8))

    def loss_and_grads(m):
        model.zero_grad()
        loss = m(idx).logsumexp(-1).mean()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    eager_loss, eager_grads = loss_and_grads(model)
    torch._dynamo.reset()
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model, fullgraph=ONE_GRAPH))
    assert abs(eager_loss - compiled_loss) <= 1e-5
    assert max((a - b).abs().max() for a, b in zip(eager_grads, compiled_grads,
                                                    strict=True)) <= 1e-4


@pytest.mark.parametrize("positions, extra", [
    ("rope", {}), ("learned", {}), ("alibi", {"window": 3}), ("relative", {}),
    ("rope", {"block": {"similarity": "cosine"}}), ("rope", {"block": {"attention": "linear"}}),
])
def test_last_only_gives_the_last_positions_logits(positions, extra):
    """The last block then runs its last query alone: its logits, and the cache it leaves
    for the next step, are those of the whole forward."""
    model = tiny(positions, **extra)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(1, 37, (3, 9), generator=g)
    left_pad = torch.tensor([0, 3, 1])
    with torch.no_grad():
        full, last = model(idx, left_pad=left_pad), model(idx, left_pad=left_pad, last_only=True)
        assert last.shape == (3, 1, 37)
        torch.testing.assert_close(last[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)
        # Through the cache: a prompt of 6, then 3 more at once, each keeping the last logits.
        cache = model.new_cache(3, 9)
        first = model(idx[:, :6], left_pad=left_pad, cache=cache, last_only=True)
        then = model(idx[:, 6:], left_pad=left_pad, cache=cache, last_only=True)
    torch.testing.assert_close(first[:, 0], full[:, 5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(then[:, 0], full[:, -1], rtol=1e-5, atol=1e-5)


def test_a_block_computes_its_last_positions_alone(monkeypatch):
    """``last`` skips the other queries: the same rows as the full block, and the block's
    attention sees a query of ``last`` rows (keys and cache cover every position), unless
    the layer is captured (``qkv.viz.capture``), whose maps keep every query."""
    from qkv.nn import attention as layer_module
    from qkv.viz import capture

    model = tiny("rope")
    block, seen = model.blocks[0], []
    x = torch.randn(2, 8, 16)
    positions = model.positions.for_layers(torch.arange(8))
    real = layer_module.attention
    monkeypatch.setattr(layer_module, "attention", lambda q, k, v, **kw: (
        seen.append((q.shape[2], k.shape[2])) or real(q, k, v, **kw)))
    with torch.no_grad():
        full = block(x, mask=qkv.causal(), positions=positions)
        cache = block.new_cache(2, 8)
        last = block(x, mask=qkv.causal(), positions=positions, cache=cache, last=3)
        assert seen == [(8, 8), (3, 8)] and cache.length == 8
        torch.testing.assert_close(last, full[:, -3:], rtol=1e-6, atol=1e-6)
        with capture(model, layers=0) as maps:
            captured = block(x, mask=qkv.causal(), positions=positions, last=3)
    assert maps.get(0).calls[0].shape[-2:] == (8, 8)
    torch.testing.assert_close(captured, last, rtol=1e-6, atol=1e-6)
