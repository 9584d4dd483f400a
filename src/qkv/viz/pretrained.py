"""``qkv viz --model NAME_OR_PATH``: the attention of a pretrained checkpoint.

``qkv.models.load_pretrained`` gives the model (a GPT, or a BERT-style Encoder) and its
tokenizer. The text is encoded (through the chat template with ``--chat``), run once, and for
a GPT ``--generate N`` then decodes N tokens greedily through the KV cache: every generated
token is fed back once, so its query row (against the cached keys) is captured too.
"""

from __future__ import annotations

import torch

from .. import models
from ..models import GPT
from .labels import token_labels
from .scene import Scene, encode_text, record_maps, without_head


def greedy_with_rows(model, ids: list[int], count: int, eos_id: int | None) -> list[int]:
    """ids + up to ``count`` greedy tokens; each new token goes through the model once, so
    its attention row exists (stops after eos_id)."""
    cache = model.new_cache(1, len(ids) + count)
    logits = model(torch.tensor([ids]), cache=cache)
    out = list(ids)
    for _ in range(count):
        token = int(logits[0, -1].argmax())
        out.append(token)
        logits = model(torch.tensor([[token]]), cache=cache)
        if token == eos_id:
            break
    return out


def load_with_tokenizer(args):
    """(model, tokenizer) of ``args.model``, refusing a run directory beside it and a
    checkpoint without a tokenizer."""
    if args.run_dir is not None:
        raise ValueError("give a run directory or --model, not both")
    model, tokenizer = models.load_pretrained(args.model)
    if tokenizer is None:
        raise ValueError(f"--model {args.model}: the checkpoint has no tokenizer "
                         "(tokenizer.json), so --text cannot be read")
    return model, tokenizer


def pretrained_scene(args) -> Scene:
    """The Scene of ``args.model``."""
    model, tokenizer = load_with_tokenizer(args)
    return model_scene(model, tokenizer, args.model, args)


def model_scene(model, tokenizer, label: str, args) -> Scene:
    """The Scene of a loaded qkv model (a GPT or an Encoder) and its tokenizer, named
    ``label``; ``args`` as ``qkv viz`` parses them (text, chat, generate, layers, heads, ...)."""
    model.eval()
    is_gpt = isinstance(model, GPT)
    if args.generate and not is_gpt:
        raise ValueError(f"--generate needs a decoder (GPT) model; {label} is an encoder")
    text = args.text
    if args.chat:
        if text is None:
            raise ValueError("--chat needs --text (the user's message)")
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True)
        except ValueError as e:
            raise ValueError(f"--chat: {label}: {e}") from None
    limit = model.config.block_size if is_gpt else model.config.max_len
    ids = encode_text(tokenizer, text, limit, "--model", args.generate)
    everything = list(ids)

    def forward():
        if args.generate:
            everything[:] = greedy_with_rows(model, ids, args.generate,
                                             getattr(tokenizer, "eos_id", None))
        else:
            with without_head(model):
                model(torch.tensor([ids]))

    maps, recorder = record_maps(model, args, forward, layer_count=model.config.n_layer,
                                 tokens=len(ids) + args.generate,
                                 rollout_stacks=() if is_gpt else ("blocks",))
    labels = token_labels(tokenizer, everything)
    first_generated = len(ids) if len(everything) > len(ids) else None
    if first_generated is not None:
        print("generated: " + tokenizer.decode(everything[len(ids):]))
    name = f"{label}: " + ("causal self-attention" if is_gpt else "self-attention")
    view = recorder.view(maps.select(), name, labels, labels, first_generated=first_generated)
    return Scene("gpt" if is_gpt else "encoder", [view])
