"""``qkv viz``: the interactive attention page (and pictures) of a trained run or a
pretrained model.

    qkv viz runs/lm --text "Return the" -o attention.html
    qkv viz runs/demo --text "zweiundvierzig" --png pictures/
    qkv viz runs/digits --image 3
    qkv viz --model smollm2 --text "The capital of France is" --generate 8
    qkv viz --model minilm --text "The cat sat on the mat."

lm runs show GPT's causal self-attention over the text; translate runs translate the text and
show the encoder's and decoder's self-attention and the cross-attention; vit runs show a
held-out image's patches; ``--model`` shows a checkpoint's self-attention (``pretrained``).
Maps come from ``qkv.viz.capture`` on the normal forward pass, streamed layer by layer into
compact rows (``qkv.viz.record``).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

import numpy as np
import torch

from .. import threads
from ..data.atomic import write_text_atomic
from ..data.text import read_nonempty_text
from ..data.tokenizers import BOS_ID, EOS_ID
from ..train.rundir import LoadedRun, load_run
from ..train.tasks.translate import translate_batch
from ..train.tasks.vit import load
from .compact import cap_rows
from .labels import token_labels
from .page import PageImage, render_page
from .pretrained import pretrained_scene
from .record import NEURON_BUDGET
from .rollout import patch_relevance
from .scene import Scene, encode_text, record_maps, without_head
from .serve import serve_command

# The largest page written unless --max-per-row is given: a browser opens it in seconds.
PAGE_BUDGET = 24 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", help="a run directory written by `qkv train`")
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help="a pretrained checkpoint instead of a run: minilm, smollm2, or a "
                   "GPT-2 / LLaMA-family / BERT directory or .gguf file")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--text", help="the text to look at (lm and translate runs, --model)")
    text.add_argument("--text-file", metavar="PATH",
                      help="read the text from a UTF-8 file instead (for long texts)")
    p.add_argument("--generate", type=int, default=0, metavar="N",
                   help="--model GPT: also generate N tokens (greedy) and show their rows")
    p.add_argument("--chat", action="store_true",
                   help="--model chat models: wrap --text in the chat template first")
    p.add_argument("--image", type=int, default=0,
                   help="vit runs: which held-out image (default 0)")
    p.add_argument("-o", "--output", default="attention.html", help="the page to write")
    p.add_argument("--layers", type=_indices, help="comma-separated layer indices (default all)")
    p.add_argument("--heads", type=_indices, help="comma-separated head indices (default all)")
    p.add_argument("--png", metavar="DIR", help="also write pictures (heatmaps per layer, "
                   "cross-attention alignments, the ViT rollout) into DIR")
    p.add_argument("--svg", action="store_true", help="write the pictures as SVG instead of PNG")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="the page stores and draws weights of at least this (default 0.01)")
    p.add_argument("--max-per-row", type=int, metavar="K",
                   help="store at most the K largest weights per query (default: no cap)")
    p.add_argument("--serve", action="store_true",
                   help="instead of a page file: a local server (127.0.0.1) that computes any "
                   "row or window of any head when the browser asks (long texts)")
    p.add_argument("--port", type=int, default=0,
                   help="--serve: the port (default: a free one)")
    p.add_argument("--no-open", dest="open", action="store_false",
                   help="--serve: print the address without opening a browser")
    p.add_argument("--neuron-layers", type=_indices,
                   help="layers whose q and k the page keeps for the neuron view (default: "
                   f"the first layers that fit {NEURON_BUDGET >> 20} MB)")


def _indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers; got {text!r}") from None


def _lm_scene(run: LoadedRun, args) -> Scene:
    tok, model = run.tokenizers["tokenizer"], run.model
    ids = encode_text(tok, args.text, model.config.block_size, "an lm run")
    def forward():
        with without_head(model):
            model(torch.tensor([ids]))

    maps, recorder = record_maps(model, args, forward, layer_count=model.config.n_layer,
                                 tokens=len(ids))
    labels = token_labels(tok, ids)
    return Scene("gpt", [recorder.view(maps.select(), "GPT self-attention", labels, labels)])


def _translate_scene(run: LoadedRun, args) -> Scene:
    src_tok, tgt_tok, cfg = run.tokenizers["tokenizer_src"], run.tokenizers["tokenizer_tgt"], \
        run.config
    src_ids = encode_text(src_tok, args.text, cfg.data.max_len, "a translate run")
    translation = translate_batch(run.model, tgt_tok, src_tok, [args.text], cfg.eval.beam_size,
                                  cfg.eval.length_penalty, cfg.data.max_len)[0]
    tgt_ids = tgt_tok.encode(translation)
    src, tgt_in = torch.tensor([src_ids]), torch.tensor([[BOS_ID] + tgt_ids])
    model_cfg = run.model.config
    maps, recorder = record_maps(
        run.model, args, lambda: run.model(src, tgt_in), rollout_stacks=("encoder",),
        layer_count=max(model_cfg.n_encoder_layers, model_cfg.n_decoder_layers),
        tokens=max(len(src_ids), len(tgt_ids) + 1))
    src_labels = token_labels(src_tok, src_ids)
    tgt_in_labels = token_labels(tgt_tok, [BOS_ID] + tgt_ids)
    # Decoder position i reads tgt_in[:i+1] and predicts output i: label queries by output.
    tgt_out_labels = token_labels(tgt_tok, tgt_ids + [EOS_ID])
    views = []
    for stack, name in (("encoder", "encoder self-attention"),
                        ("decoder", "decoder self-attention")):
        if stack in maps.stacks():
            labels = src_labels if stack == "encoder" else tgt_in_labels
            views.append(recorder.view(maps.select(stack=stack), name, labels, labels))
    views.append(recorder.view(maps.select(cross=True),
                               "decoder cross-attention (target x source)", tgt_out_labels,
                               src_labels))
    print(f"translation: {translation}")
    return Scene("seq2seq", views)


def _vit_scene(run: LoadedRun, args) -> Scene:
    if args.text is not None:
        raise ValueError("vit runs show an image: pass --image N (a held-out image), not --text")
    _, test = load(run.config.data)
    if not 0 <= args.image < len(test.labels):
        raise ValueError(f"--image {args.image} is out of range: the held-out set has images "
                         f"0..{len(test.labels) - 1}")
    image = torch.from_numpy(test.images[args.image : args.image + 1])
    gh, gw = run.model.config.grid
    maps, recorder = record_maps(run.model, args, lambda: run.model(image),
                                 layer_count=run.model.config.n_layer, tokens=gh * gw + 1,
                                 rollout_stacks=("blocks",))
    labels = ["[CLS]"] + [f"p({r},{c})" for r in range(gh) for c in range(gw)]
    view = recorder.view(maps.select(), f"ViT self-attention (image {args.image}, class "
                         f"{test.classes[test.labels[args.image]]})", labels, labels)
    relevance = None
    if view.rollout is not None:
        rolled = view.rollout.unsqueeze(0)
        cls = run.model.config.pooling == "cls"
        relevance = patch_relevance(rolled if cls else rolled[:, 1:, 1:], (gh, gw),
                                    cls_token=cls)[0]
    return Scene("vit", [view], PageImage(image[0], (gh, gw), cls_token=True), relevance)


SCENES = {"lm": _lm_scene, "translate": _translate_scene, "vit": _vit_scene}


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower().split(" (")[0]).strip("-")


def write_pictures(scene: Scene, folder, suffix: str) -> list[Path]:
    """Per view and layer a grid of heads; cross-attention also as a head-mean alignment;
    for a ViT the rollout over the image. The pictures show the weights the page stores,
    under the page's token labels."""
    from . import plots  # matplotlib, an optional dependency

    folder, written = Path(folder), []
    for view in scene.views:
        nk = len(view.key_tokens)
        for i, layer in enumerate(view.layers):
            mapped = [(h, rows) for h, rows in zip(view.heads, view.rows[i], strict=True)
                      if rows is not None]  # a long input's page maps the chosen heads only
            if not mapped:
                continue
            weights = torch.from_numpy(np.stack([rows.dense(nk) for _, rows in mapped]))
            base = f"{_slug(view.name)}-layer{layer}"
            fig = plots.plot_heads(weights, view.query_tokens, view.key_tokens,
                                   heads=[h for h, _ in mapped], title=f"layer {layer}")
            written.append(plots.save_figure(fig, folder / f"{base}{suffix}"))
            if view.kind == "cross":
                fig = plots.plot_alignment(weights.mean(0), view.key_tokens, view.query_tokens,
                                           title=f"cross-attention layer {layer}, head mean")
                written.append(plots.save_figure(fig, folder / f"{base}-alignment{suffix}"))
    if scene.relevance is not None:
        fig = plots.plot_image_relevance(scene.image.pixels, scene.relevance)
        written.append(plots.save_figure(fig, folder / f"vit-rollout{suffix}"))
    return written


def utf8_size(text: str) -> int:
    return len(text.encode("utf-8"))


def cap_view(view, k: int):
    """``view`` with each row's ``k`` largest weights, and its neuron data's per-entry scores
    cut to match."""
    if view.rows is None:
        return view
    capped = [[None if r is None else cap_rows(r, k) for r in layer] for layer in view.rows]
    neurons = []
    for n in view.neurons:
        keep = [mask for _, mask in capped[view.layers.index(n.layer)]]
        cut = [s[m] for s, m in zip(n.scores, keep, strict=True)]
        sims = None if n.similarity_scores is None else \
            [s[m] for s, m in zip(n.similarity_scores, keep, strict=True)]
        neurons.append(dataclasses.replace(n, scores=cut, similarity_scores=sims))
    return dataclasses.replace(view, rows=[[None if c is None else c[0] for c in layer]
                                           for layer in capped], neurons=neurons)


def fit_budget(views, text: str, page: dict) -> str:
    """A page of at most PAGE_BUDGET bytes: each row keeps its K largest weights, K the
    largest that fits, estimated from the stored entries, and after a page over the budget
    from the line through the two pages' sizes (the per-row summaries of a long input take
    a fixed share); a line on stderr says what was left out."""
    counts = np.concatenate([r.counts for v in views if v.rows is not None
                             for layer in v.rows for r in layer if r is not None])
    entries, size = int(counts.sum()), utf8_size(text)

    def largest_k(target: float) -> int:  # the largest k with sum(min(counts, k)) <= target
        low, high = 1, max(1, int(counts.max()))
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if np.minimum(counts, mid).sum() <= target else (low, mid - 1)
        return low

    k = largest_k(entries * PAGE_BUDGET / size * 0.9)  # page bytes grow with the entries
    while True:
        text = render_page([cap_view(v, k) for v in views], **{**page, "max_per_row": k})
        if utf8_size(text) <= PAGE_BUDGET or k == 1:
            break
        kept = int(np.minimum(counts, k).sum())
        per_entry = (size - utf8_size(text)) / max(1, entries - kept)
        fewer = kept - (utf8_size(text) - 0.97 * PAGE_BUDGET) / max(per_entry, 1e-9)
        k = min(k // 2 if per_entry <= 0 else k - 1, largest_k(fewer))
    print(f"qkv: the page keeps each row's {k} largest weights to stay within "
          f"{PAGE_BUDGET >> 20} MB (--max-per-row or a higher --threshold choose otherwise)",
          file=sys.stderr)
    return text


def _scene(args) -> tuple[Scene, str]:
    """The scene to show and the page's title."""
    if args.model is not None:
        return pretrained_scene(args), f"qkv attention: {args.model}"
    if args.run_dir is None:
        raise ValueError("give a run directory (from `qkv train`) or --model NAME_OR_PATH")
    for flag, given in (("--generate", args.generate), ("--chat", args.chat)):
        if given:
            raise ValueError(f"{flag} works with --model (a pretrained checkpoint), not with "
                             "a run directory")
    loaded = load_run(args.run_dir)
    return SCENES[loaded.task](loaded, args), f"qkv attention: {loaded.path.name}"


def _file_in_the_way(folder: Path) -> Path | None:
    """The file (not a folder) at ``folder`` or at its nearest existing parent, which stops
    ``folder`` from being created or written into; None when there is none."""
    for path in (folder, *folder.parents):
        if path.exists():
            return None if path.is_dir() else path
    return None


def check_outputs(args) -> None:
    """Refuse outputs that cannot be written before any work is done."""
    output = Path(args.output)
    if output.is_dir():
        raise ValueError(f"-o/--output {args.output!r} is a directory; expected a file name "
                         f"such as {str(output / 'attention.html')!r}")
    blocker = _file_in_the_way(output.parent)
    if blocker is not None:
        raise ValueError(f"-o/--output {args.output!r} cannot be written: {str(blocker)!r} is a "
                         "file, not a folder")
    blocker = _file_in_the_way(Path(args.png)) if args.png else None
    if blocker is not None:
        raise ValueError(f"--png {args.png!r}: {str(blocker)!r} is a file; expected a folder "
                         "for the pictures (a new or an existing one)")


def run(args: argparse.Namespace) -> int:
    if not 0.0 < args.threshold < 1.0:
        raise ValueError(f"--threshold must be in (0, 1); got {args.threshold}")
    if args.max_per_row is not None and args.max_per_row < 1:
        raise ValueError(f"--max-per-row must be at least 1; got {args.max_per_row}")
    if args.generate < 0:
        raise ValueError(f"--generate must be >= 0; got {args.generate}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: a free port); got {args.port}")
    if not args.serve:
        check_outputs(args)
    if args.text_file is not None:
        args.text = read_nonempty_text(args.text_file, "--text-file")
    threads.configure(args.threads)
    if args.serve:
        return serve_command(args)
    scene, title = _scene(args)
    page = dict(mode=scene.mode, image=scene.image, threshold=args.threshold,
                max_per_row=args.max_per_row, title=title)
    text = render_page(scene.views, **page)
    if utf8_size(text) > PAGE_BUDGET and args.max_per_row is None:
        text = fit_budget(scene.views, text, page)
    path = write_text_atomic(args.output, text)
    print(f"attention page: {path} ({utf8_size(text) / 1e6:.1f} MB)")
    if args.png:
        for picture in write_pictures(scene, args.png, ".svg" if args.svg else ".png"):
            print(f"picture: {picture}")
    return 0
