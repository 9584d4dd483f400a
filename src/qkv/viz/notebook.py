"""``qkv.viz.show``: the attention page of one text, inline in a Jupyter notebook.

The page is the one ``qkv viz -o page.html`` writes (offline, self-contained: its data, script
and style inline); in a notebook it sits in an iframe's ``srcdoc``, so that its element ids
and script stay apart from the notebook's and from other pages shown beside it. The maps come
from the fast path: a qkv model's layers are captured as ``qkv viz`` captures them; a Hugging
Face model returns them with ``output_attentions=True`` (with ``attn_implementation="qkv"``,
from qkv's engines).
"""

from __future__ import annotations

import html
from pathlib import Path
from types import SimpleNamespace

import torch

from .. import models
from ..data.atomic import write_text_atomic
from .capture import CapturedMap, ObservedCall
from .labels import token_labels
from .page import render_page
from .pretrained import model_scene
from .record import Recorder
from .weights import check_heads


class AttentionView:
    """An attention page that Jupyter renders inline (``_repr_html_``); ``html`` is the page
    itself and ``save(path)`` writes it as ``qkv viz -o`` would."""

    def __init__(self, page: str, height: int):
        self.html, self.height = page, height

    def _repr_html_(self) -> str:
        return (f'<iframe srcdoc="{html.escape(self.html, quote=True)}" '
                f'style="width: 100%; height: {self.height}px; border: 0" '
                'sandbox="allow-scripts"></iframe>')

    def save(self, path) -> Path:
        return write_text_atomic(path, self.html)


def show(model_or_name, text: str, *, tokenizer=None, layers=None, heads=None,
         threshold: float = 0.01, max_per_row: int | None = None,
         height: int = 640) -> AttentionView:
    """The attention of ``text`` in ``model_or_name``, as a page a notebook shows inline.

    Args:
        model_or_name: a pretrained name or path (``"smollm2"``, ``"minilm"``, a directory or
            a .gguf file), a qkv model (GPT or Encoder), or a Hugging Face model.
        text: what to look at.
        tokenizer: the tokenizer of a model object (a name brings its own).
        layers, heads: which layers and query heads (None: all), as ``qkv viz`` takes them.
        threshold, max_per_row: what each stored row keeps (``qkv viz`` options).
        height: the inline frame's height in pixels.
    """
    if not isinstance(text, str) or not text:
        raise ValueError("text must be a non-empty string")
    if isinstance(height, bool) or not isinstance(height, int) or height < 100:
        raise ValueError(f"height must be an int of at least 100 pixels; got {height!r}")
    args = SimpleNamespace(text=text, chat=False, generate=0, layers=layers, heads=heads,
                           threshold=threshold, max_per_row=max_per_row, neuron_layers=None)
    if isinstance(model_or_name, (str, Path)):
        if tokenizer is not None:
            raise ValueError("a pretrained name brings its own tokenizer; pass tokenizer= only "
                             "with a model object")
        model, tokenizer = models.load_pretrained(str(model_or_name))
        label = str(model_or_name)
    else:
        model, label = model_or_name, type(model_or_name).__name__
        if tokenizer is None:
            raise ValueError(f"show({label}, ...) needs tokenizer= to read the text")
    if isinstance(model, (models.GPT, models.Encoder)):
        scene = model_scene(model, tokenizer, label, args)
        page = render_page(scene.views, mode=scene.mode, title=f"qkv attention: {label}",
                           threshold=threshold, max_per_row=max_per_row)
    elif hasattr(model, "config") and hasattr(model.config, "num_hidden_layers"):
        page = _transformers_page(model, tokenizer, label, args)
    else:
        raise TypeError(f"model_or_name must be a pretrained name, a qkv GPT or Encoder, or a "
                        f"Hugging Face model; got {label}")
    return AttentionView(page, height)


def _transformers_page(model, tokenizer, label: str, args) -> str:
    """The page of a Hugging Face model, from the weights ``output_attentions`` returns."""
    ids = tokenizer(args.text, return_tensors="pt")["input_ids"]
    model.eval()
    with torch.no_grad():
        attentions = model(input_ids=ids, output_attentions=True).attentions
    if not attentions or any(a is None for a in attentions):
        raise ValueError(f"{label} returned no attention weights (its attention "
                         "implementation has none: use attn_implementation='qkv' or 'eager')")
    count, n_head = len(attentions), attentions[0].shape[1]
    chosen_layers = range(count) if args.layers is None else [
        layer % count for layer in args.layers if -count <= layer < count]
    chosen = check_heads(args.heads, n_head, label)
    recorder, sites = Recorder(args.threshold, args.max_per_row), []
    for layer in chosen_layers:
        site = CapturedMap(f"layers.{layer}.self_attn", "layers", layer, False, chosen)
        weights = attentions[layer][:, chosen].float()
        shape = (1, n_head, ids.shape[1], 0)
        recorder(site, weights, ObservedCall(model, torch.empty(shape), torch.empty(shape),
                                             None, None))
        sites.append(site)
    labels = token_labels(tokenizer, ids[0].tolist())
    causal = bool(getattr(model.config, "is_decoder", False)) or "CausalLM" in label
    view = recorder.view(sites, f"{label}: " + ("causal self-attention" if causal
                                                else "self-attention"), labels, labels)
    return render_page([view], mode="gpt" if causal else "encoder",
                       title=f"qkv attention: {label}", threshold=args.threshold,
                       max_per_row=args.max_per_row)
