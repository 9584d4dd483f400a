"""SmolLM2-135M-Instruct (GGUF, Q4_1) through qkv against transformers' LlamaForCausalLM
dequantized from the same file (issue 12's parity targets: logits rel ≤ 1e-4 on a padded
batch, 64 greedy tokens identical, held-out perplexity within 1e-4 relative, tokenizer ids
and chat template identical)."""

import math

import pytest
import torch
import torch.nn.functional as F

from qkv.models import GPT
from qkv.train.tasks.lm import LMData, corpus

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):\n",
    "The three laws of motion, as Newton stated them in 1687, are",
    "Hi",
]


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
def test_logits_match_on_a_padded_batch(smollm2, hf_smollm2):
    model, tokenizer = smollm2
    assert isinstance(model, GPT) and model.config.block.n_kv_head == 3
    assert model.config.n_layer == 30
    rows = [tokenizer.encode(p) for p in PROMPTS]
    n = max(map(len, rows))
    left_pad = torch.tensor([n - len(r) for r in rows])
    assert int(left_pad.min()) == 0 and int(left_pad.max()) > 10  # really padded
    # Left padding for both: HF gets the mask and each row's positions counted from its first
    # real token; qkv gets left_pad, from which it derives the same two.
    ids = torch.tensor([[tokenizer.pad_id] * p + r for p, r in zip(left_pad.tolist(), rows,
                                                                   strict=True)])
    real = torch.arange(n) >= left_pad[:, None]
    with torch.no_grad():
        ours = model(ids, left_pad=left_pad)
        ref = hf_smollm2(input_ids=ids, attention_mask=real.long(),
                         position_ids=(real.long().cumsum(1) - 1).clamp(min=0)).logits
    # Only real positions: a padded query's logits mean nothing, and HF lets a pad query
    # attend to nothing (or to itself) where qkv may differ.
    err = rel_err(ours[real], ref[real])
    print(f"SmolLM2 padded-batch logits rel err {err:.2e}")
    assert err <= 1e-4
    # The padded row's logits equal the same prompt alone: padding does not leak in.
    i = int(left_pad.argmax())
    with torch.no_grad():
        alone = model(torch.tensor([rows[i]]))[0]
    assert rel_err(ours[i, left_pad[i]:], alone) <= 1e-5


@pytest.mark.slow
def test_greedy_generation_matches_hugging_face(smollm2, hf_smollm2):
    model, tokenizer = smollm2
    ids = torch.tensor([tokenizer.encode(PROMPTS[1])])
    ref = hf_smollm2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=64,
                              do_sample=False)
    assert ref.shape[1] == ids.shape[1] + 64  # HF did not stop early at <|im_end|>
    ours = model.generate(ids, 64, temperature=0, eos_id=tokenizer.eos_id)
    assert ours.tolist() == ref.tolist(), tokenizer.decode(ours[0])
    assert "return" in tokenizer.decode(ours[0])  # it writes the function


@pytest.mark.slow
def test_batched_greedy_generation_matches_hugging_face(smollm2, hf_smollm2):
    # qkv takes right-padded prompts with lengths; HF takes them left-padded with a mask.
    model, tokenizer = smollm2
    rows = [tokenizer.encode(p) for p in PROMPTS[1:]]
    n, new = max(map(len, rows)), 8
    pad = tokenizer.pad_id
    right = torch.tensor([r + [pad] * (n - len(r)) for r in rows])
    left = torch.tensor([[pad] * (n - len(r)) + r for r in rows])
    ours = model.generate(right, new, temperature=0, lengths=torch.tensor(list(map(len, rows))))
    ref = hf_smollm2.generate(left, attention_mask=(left != pad).long(), max_new_tokens=new,
                              do_sample=False)
    for i, r in enumerate(rows):
        assert ours[i, len(r):len(r) + new].tolist() == ref[i, n:].tolist(), i


@pytest.mark.slow
def test_held_out_perplexity_matches_hugging_face(smollm2, hf_smollm2):
    model, tokenizer = smollm2
    # The held-out tail (10%) of the corpus `qkv train lm` builds from 12,000 characters of
    # standard-library docstrings: ~270 tokens, enough to average over and quick to score.
    _, held_out = corpus(LMData(max_chars=12_000))
    ids = torch.tensor([tokenizer.encode(held_out)])
    assert 200 <= ids.shape[1] <= 1200

    def perplexity(logits):  # in float64, so the comparison is not hidden by rounding
        return math.exp(F.cross_entropy(logits[0, :-1].double(), ids[0, 1:]).item())

    with torch.no_grad():
        ours, ref = perplexity(model(ids)), perplexity(hf_smollm2(ids).logits)
    print(f"SmolLM2 held-out perplexity qkv {ours:.6f} HF {ref:.6f} "
          f"rel {abs(ours - ref) / ref:.2e}")
    assert abs(ours - ref) <= 1e-4 * ref
    assert ours < 60  # a model that reads English (a broken load scores in the thousands)


SMOLLM_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")


def smollm_reference(hf):
    """HF's tokenizer from the GGUF (its vocabulary, merges and special tokens) splitting text
    as llama.cpp does for tokenizer.ggml.pre = "smollm": every \\p{N} character alone, then
    GPT-2's regex. transformers' GGUF loader has no "smollm" entry and splits with GPT-2's
    regex only, unlike SmolLM2's own tokenizer.json (Digits(individual_digits) + ByteLevel):
    it differs where a numeric character follows spaces ("  0": "Ġ" "Ġ" "0" vs "ĠĠ" "0") or
    is not an ASCII digit ("Ⅸ")."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    ref = Tokenizer.from_str(hf.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.Split(Regex(SMOLLM_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return ref


@pytest.mark.slow
def test_tokenizer_ids_match_hugging_face(smollm2, hf_smollm2_tokenizer, varied_strings):
    _, tokenizer = smollm2
    hf, ref = hf_smollm2_tokenizer, smollm_reference(hf_smollm2_tokenizer)
    specials = ["<|im_start|>user\nhi<|im_end|>\n", "a<|endoftext|>b", "<|im_end|><|im_start|>",
                "x <|im_start|> y", "<repo_name>qkv<file_sep>main.py\n", "12  \n  345 Ⅸ ½"]
    strings = varied_strings + specials
    # Against transformers' tokenizer as loaded: every string without a numeric character.
    plain = [s for s in strings if not any(c.isnumeric() for c in s)]
    assert len(plain) >= 250
    mismatched = [s for s in plain if tokenizer.encode(s) != hf(s)["input_ids"]]
    assert not mismatched, mismatched[:5]
    # Against the same vocabulary with llama.cpp's "smollm" splitting: every string.
    assert len(strings) >= 300
    mismatched = [s for s in strings if tokenizer.encode(s) != ref.encode(s).ids]
    assert not mismatched, mismatched[:5]
    assert tokenizer.token_strings(tokenizer.encode("x  \n  2024")) == [
        "x", "ĠĠ", "ĊĠĠ", "2", "0", "2", "4"]
    assert tokenizer.encode("<|im_start|>") == [1] and tokenizer.special_ids >= {0, 1, 2}
    for s in strings:  # byte-level BPE loses nothing: decoding gives the text back
        ids = tokenizer.encode(s)
        assert tokenizer.decode(ids, skip_special_tokens=False) == s
        assert tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)


CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in French."},
     {"role": "user", "content": "Say hello."},
     {"role": "assistant", "content": "Bonjour !"},
     {"role": "user", "content": "And goodbye, with ünïcödé and\nnew lines?"}],
]


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["no-system", "system-multi-turn"])
def test_chat_template_matches_hugging_face(smollm2, hf_smollm2_tokenizer, messages):
    _, tokenizer = smollm2
    ref = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True)
    assert tokenizer.apply_chat_template(messages) == ref
    assert ref.endswith("<|im_start|>assistant\n")
    without = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=False)
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == without
