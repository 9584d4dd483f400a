"""transformers' own SmolLM2-135M-Instruct, the reference the pretrained tests compare with.

transformers reads the shipped GGUF file in Python (its fields, its vocabulary, its tensor
names), which takes 20-30 s for the model and 5 for the tokenizer on a 2-core machine. The
first test process to need them converts them once and saves them under qkv's cache (the
float32 state dict, the config and generation config, and the converted tokenizer: the same
numbers and ids); the others load that folder in a few seconds. transformers refuses
``save_pretrained`` on a model loaded from GGUF, so the state dict is saved as it is. The
folder is named by the GGUF file's size and time and transformers' version, and appears
whole or not at all (``qkv.cache.publish_folder``), so two test workers converting at once
cannot leave a partial copy.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from qkv.cache import cache_dir, publish_folder
from qkv.models.pretrained import resolve


def converted_folder() -> Path:
    """A folder with transformers' conversion of the GGUF file (model and tokenizer)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = resolve("smollm2")
    stat = gguf.stat()
    key = f"{gguf.name} {stat.st_size} {stat.st_mtime_ns} {transformers.__version__}"
    folder = (cache_dir() / "tests"
              / f"hf-smollm2-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    if folder.is_dir():
        return folder
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)

    def save(staging: Path) -> None:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # GGUF's, which the float32 copy has not
        type(model.config).from_dict(config).save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        torch.save(model.state_dict(), staging / "state_dict.pt")
        tokenizer.save_pretrained(staging)

    return publish_folder(folder, save)


def hf_model():
    """transformers' LlamaForCausalLM with SmolLM2's float32 weights, in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    folder = converted_folder()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                             dtype=torch.float32)
    model.load_state_dict(torch.load(folder / "state_dict.pt", weights_only=True))
    model.generation_config = GenerationConfig.from_pretrained(folder)
    return model.eval()


def hf_tokenizer():
    """transformers' tokenizer converted from the same GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted_folder())
