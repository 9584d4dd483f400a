"""all-MiniLM-L6-v2 through qkv against transformers' BertModel and sentence-transformers, on
the real weights (issue 12's parity targets: hidden states rel ≤ 1e-5, embeddings cos ≥
0.99999, identical search ranking, identical token ids)."""

import pytest
import torch

from qkv.models import Encoder

SENTENCES = [
    "A man is eating food.",
    "Hi",
    "The quick brown fox jumps over the lazy dog near the riverbank, doesn't it?!",
    "Crème brûlée, jalapeño & smörgåsbord — 北京 東京 😀 (unicode).",
    "x = [i ** 2 for i in range(10)]  # squares",
    # ~200 tokens: sentence-transformers truncates at 256, so stay under it.
    " ".join(["Attention lets every token look at every other token, weighting each by a "
              "softmax of query-key similarities."] * 9),
]


def _batch(tokenizer, texts):
    """Right-padded ids (B, N) and lengths (B,), from qkv's own tokenizer."""
    ids = [tokenizer.encode(t) for t in texts]
    lengths = torch.tensor([len(x) for x in ids])
    out = torch.full((len(ids), int(lengths.max())), tokenizer.pad_id)
    for row, x in zip(out, ids, strict=True):
        row[:len(x)] = torch.tensor(x)
    return out, lengths


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.slow
def test_last_hidden_state_matches_bert_model(minilm, hf_bert):
    model, tokenizer = minilm
    assert isinstance(model, Encoder) and model.config.num_classes == 0
    ids, lengths = _batch(tokenizer, SENTENCES)
    assert ids.shape[1] > 150 and int(lengths.min()) == 3  # really padded: [CLS] hi [SEP]
    real = torch.arange(ids.shape[1]) < lengths[:, None]
    with torch.no_grad():
        ours = model(ids, lengths=lengths)
        ref = hf_bert(input_ids=ids, attention_mask=real.long()).last_hidden_state
    # Only real positions are compared: a padded position's vector is defined by nothing (no
    # key attends to it, pooling drops it), and implementations may leave garbage there.
    err = rel_err(ours[real], ref[real])
    print(f"MiniLM last hidden state rel err {err:.2e}")
    assert err <= 1e-5
    # Padding must not leak into real rows: each sentence alone gives the same states.
    with torch.no_grad():
        for i in (1, 3):
            alone = model(ids[i:i + 1, :lengths[i]])[0]
            assert rel_err(ours[i, :lengths[i]], alone) <= 1e-5


@pytest.fixture(scope="module")
def reference_embeddings(sentence_transformer):
    return lambda texts: sentence_transformer.encode(
        texts, convert_to_tensor=True, batch_size=64, show_progress_bar=False).cpu()


def _embed(minilm, texts):
    model, tokenizer = minilm
    with torch.no_grad():
        return model.embed(*_batch(tokenizer, texts))


@pytest.mark.slow
def test_sentence_embeddings_match_sentence_transformers(minilm, reference_embeddings):
    ours, ref = _embed(minilm, SENTENCES), reference_embeddings(SENTENCES)
    cos = torch.nn.functional.cosine_similarity(ours, ref)
    print(f"MiniLM embedding cosine min {cos.min().item():.8f}")
    assert cos.min().item() >= 0.99999
    # The directory's modules.json ends in Normalize: unit vectors, as sentence-transformers.
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))


QUERIES = ["How do I bake bread at home?", "Which animal is the fastest on land?",
           "build a list of squared numbers in one line"]
DOCUMENTS = [
    "Mix flour, water, salt and yeast, let the dough rise, then bake it in a hot oven.",
    "The cheetah can run faster than any other land animal, reaching 100 km/h.",
    "squares = [x * x for x in numbers] builds a new list in one expression.",
    "The stock market fell sharply on Tuesday after the interest-rate decision.",
    "Sourdough loaves need a starter and a long, slow fermentation.",
    "Falcons are the fastest birds when they dive.",
    "A for loop in Python iterates over the items of any sequence.",
    "The Eiffel Tower is in Paris.",
    "Regular exercise improves sleep and mood.",
    "Tomatoes are botanically fruits, though cooks treat them as vegetables.",
]


@pytest.mark.slow
def test_semantic_search_ranks_identically(minilm, reference_embeddings):
    ours = _embed(minilm, QUERIES) @ _embed(minilm, DOCUMENTS).T
    ref = reference_embeddings(QUERIES) @ reference_embeddings(DOCUMENTS).T
    assert torch.equal(ours.argsort(dim=1, descending=True), ref.argsort(dim=1, descending=True))
    assert ours.argmax(dim=1).tolist() == [0, 1, 2]  # and the ranking makes sense
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)


def test_tokenizer_ids_match_hugging_face(minilm_tokenizer, hf_bert_tokenizer, varied_strings):
    tokenizer = minilm_tokenizer
    assert len(varied_strings) >= 300
    mismatched = [s for s in varied_strings
                  if tokenizer.encode(s) != hf_bert_tokenizer(s)["input_ids"]]
    assert not mismatched, mismatched[:5]
    # Special tokens written in the text are kept whole, as Hugging Face does.
    ids = tokenizer.encode("[CLS] a [MASK] b [SEP]", add_special_tokens=False)
    assert ids == hf_bert_tokenizer("[CLS] a [MASK] b [SEP]", add_special_tokens=False)[
        "input_ids"]
    assert tokenizer.token_strings(ids) == ["[CLS]", "a", "[MASK]", "b", "[SEP]"]
    some = tokenizer.encode("Tokenization isn't trivial, naïvely.")
    assert tokenizer.decode(some) == hf_bert_tokenizer.decode(some, skip_special_tokens=True)
