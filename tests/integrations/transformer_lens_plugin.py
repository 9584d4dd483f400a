"""A pytest plugin that runs TransformerLens's own tests on qkv's attention
(``pytest -p transformer_lens_plugin``, with this folder on PYTHONPATH:
TransformerLens's tests have a top-level package named ``tests`` of their own).

Every bridge ``TransformerBridge.boot_transformers`` returns goes through
``qkv.integrations.transformer_lens.enable``. There is no model hub here: a test's checkpoint
name in ``STAND_INS`` boots a tiny model built from a config (with a word-level tokenizer for
its prompts) instead, and any other name fails as the hub would. At the end the plugin writes
how many attention calls qkv computed to $QKV_TL_CALLS, so the caller can tell that qkv ran.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

# The words of the prompts the selected tests tokenize.
WORDS = ("The", "capital", "of", "France", "is", "Paris", ".")

CALLS = [0]


def _stand_in(name: str):
    """(hf_model, tokenizer) for a hub checkpoint name, or None."""
    import transformer_lens_tiny as tiny  # beside this plugin, on the path the caller sets

    if name == "distilgpt2":
        # distilgpt2's 6 layers, as a LLaMA rather than GPT-2: GPT-2's bridge computes its
        # attention in torch from its joint projection, so only a LLaMA-family bridge runs
        # qkv's attention itself.
        return tiny.llama(layers=6, vocab_size=128), tiny.tokenizer(128, WORDS)
    return None


def pytest_configure(config):
    from transformer_lens.model_bridge import TransformerBridge

    from qkv.engines import api
    from qkv.integrations.transformer_lens import enable

    boot = TransformerBridge.boot_transformers

    def boot_on_qkv(model_name, *args, hf_model=None, tokenizer=None, **kwargs):
        if hf_model is None:
            found = _stand_in(model_name)
            if found is not None:
                hf_model, tokenizer = found
        bridge = boot(model_name, *args, hf_model=hf_model, tokenizer=tokenizer, **kwargs)
        return enable(bridge)

    TransformerBridge.boot_transformers = staticmethod(boot_on_qkv)
    real = api.attention

    def counted(*args, **kwargs):
        CALLS[0] += 1
        return real(*args, **kwargs)

    api.attention = counted


def pytest_unconfigure(config):
    path = os.environ.get("QKV_TL_CALLS")
    if path:
        with open(path, "w") as f:
            f.write(str(CALLS[0]))
