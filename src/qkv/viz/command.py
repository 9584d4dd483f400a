"""``qkv viz RUN_DIR``: the interactive attention page (and pictures) of a trained run.

    qkv viz runs/lm --text "Return the" -o attention.html
    qkv viz runs/demo --text "zweiundvierzig" --png pictures/
    qkv viz runs/digits --image 3

lm runs show GPT's causal self-attention over the text; translate runs translate the text and
show the encoder's and decoder's self-attention and the cross-attention; vit runs show a
held-out image's patches. Maps come from ``qkv.viz.capture`` on the normal forward pass.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .capture import AttentionMaps, CapturedMap, capture
from .page import PageImage, PageView, write_page
from .rollout import attention_rollout, patch_relevance
from .runs import LoadedRun, load_run

BOS, EOS = "<s>", "</s>"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory written by `qkv train`")
    p.add_argument("--text", help="the text to look at (lm and translate runs)")
    p.add_argument("--image", type=int, default=0,
                   help="vit runs: which held-out image (default 0)")
    p.add_argument("-o", "--output", default="attention.html", help="the page to write")
    p.add_argument("--layers", type=_indices, help="comma-separated layer indices (default all)")
    p.add_argument("--heads", type=_indices, help="comma-separated head indices (default all)")
    p.add_argument("--png", metavar="DIR", help="also write pictures (heatmaps per layer, "
                   "cross-attention alignments, the ViT rollout) into DIR")
    p.add_argument("--svg", action="store_true", help="write the pictures as SVG instead of PNG")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="the page draws edges of at least this weight (default 0.01)")


def _indices(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers; got {text!r}") from None


@dataclass
class Scene:
    """What one run shows: the page's views, its mode, and the ViT image when there is one."""

    mode: str
    views: list[PageView]
    image: PageImage | None = None
    relevance: torch.Tensor | None = None  # (gh, gw) ViT rollout over the patches


def _labels(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) or f"#{i}" for i in ids]


def _encode(tokenizer, text: str | None, limit: int, task: str) -> list[int]:
    if text is None:
        raise ValueError(f"{task} runs need --text (the text to look at)")
    ids = tokenizer.encode(text)
    if not ids:
        raise ValueError("--text encodes to no tokens")
    if len(ids) > limit:
        raise ValueError(f"--text is {len(ids)} tokens long but the model's context holds "
                         f"{limit}; shorten it")
    return ids


def _view(sites: list[CapturedMap], name: str, q_labels, k_labels, rollout: bool) -> PageView:
    weights = torch.stack([s.weights[0].float().cpu() for s in sites])  # (L, h, Nq, Nk)
    rolled = None
    if rollout:
        rolled = attention_rollout([s.weights.float().cpu() for s in sites])[0]
    return PageView(name, "cross" if sites[0].is_cross else "self", q_labels, k_labels,
                    [s.layer for s in sites], list(sites[0].heads), weights, rolled)


def _full(args) -> bool:
    """Rollout needs every layer; a chosen subset of heads is fused as given."""
    return args.layers is None


def _capture(model, args, forward) -> AttentionMaps:
    with capture(model, layers=args.layers, heads=args.heads) as maps, torch.no_grad():
        forward()
    return maps


def _lm_scene(run: LoadedRun, args) -> Scene:
    tok = run.tokenizers["tokenizer"]
    ids = _encode(tok, args.text, run.model.config.block_size, "lm")
    maps = _capture(run.model, args, lambda: run.model(torch.tensor([ids])))
    labels = _labels(tok, ids)
    return Scene("gpt", [_view(maps.select(), "GPT self-attention", labels, labels, False)])


def _translate_scene(run: LoadedRun, args) -> Scene:
    from ..data.tokenizers import BOS_ID
    from ..train.tasks.translate import translate_batch

    src_tok, tgt_tok, cfg = run.tokenizers["tokenizer_src"], run.tokenizers["tokenizer_tgt"], \
        run.config
    src_ids = _encode(src_tok, args.text, cfg.data.max_len, "translate")
    translation = translate_batch(run.model, tgt_tok, src_tok, [args.text], cfg.eval.beam_size,
                                  cfg.eval.length_penalty, cfg.data.max_len)[0]
    tgt_ids = tgt_tok.encode(translation)
    src, tgt_in = torch.tensor([src_ids]), torch.tensor([[BOS_ID] + tgt_ids])
    maps = _capture(run.model, args, lambda: run.model(src, tgt_in))
    src_labels = _labels(src_tok, src_ids)
    tgt_in_labels = [BOS] + _labels(tgt_tok, tgt_ids)
    # Decoder position i reads tgt_in[:i+1] and predicts output i: label queries by output.
    tgt_out_labels = _labels(tgt_tok, tgt_ids) + [EOS]
    views = []
    for stack, name in (("encoder", "encoder self-attention"),
                        ("decoder", "decoder self-attention")):
        if stack in maps.stacks():
            labels = src_labels if stack == "encoder" else tgt_in_labels
            views.append(_view(maps.select(stack=stack), name, labels, labels,
                               stack == "encoder" and _full(args)))
    views.append(_view(maps.select(cross=True), "decoder cross-attention (target x source)",
                       tgt_out_labels, src_labels, False))
    print(f"translation: {translation}")
    return Scene("seq2seq", views)


def _vit_scene(run: LoadedRun, args) -> Scene:
    from ..train.tasks.vit import load

    if args.text is not None:
        raise ValueError("vit runs show an image: pass --image N (a held-out image), not --text")
    _, test = load(run.config.data)
    if not 0 <= args.image < len(test.labels):
        raise ValueError(f"--image {args.image} is out of range: the held-out set has images "
                         f"0..{len(test.labels) - 1}")
    image = torch.from_numpy(test.images[args.image : args.image + 1])
    maps = _capture(run.model, args, lambda: run.model(image))
    gh, gw = run.model.config.grid
    labels = ["[CLS]"] + [f"p({r},{c})" for r in range(gh) for c in range(gw)]
    view = _view(maps.select(), f"ViT self-attention (image {args.image}, class "
                 f"{test.classes[test.labels[args.image]]})", labels, labels, _full(args))
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
    for a ViT the rollout over the image."""
    from . import plots

    folder, written = Path(folder), []
    for view in scene.views:
        for i, layer in enumerate(view.layers):
            base = f"{_slug(view.name)}-layer{layer}"
            fig = plots.plot_heads(view.weights[i], view.query_tokens, view.key_tokens,
                                   heads=view.heads, title=f"layer {layer}")
            written.append(plots.save_figure(fig, folder / f"{base}{suffix}"))
            if view.kind == "cross":
                fig = plots.plot_alignment(view.weights[i].mean(0), view.key_tokens,
                                           view.query_tokens,
                                           title=f"cross-attention layer {layer}, head mean")
                written.append(plots.save_figure(fig, folder / f"{base}-alignment{suffix}"))
    if scene.relevance is not None:
        fig = plots.plot_image_relevance(scene.image.pixels, scene.relevance)
        written.append(plots.save_figure(fig, folder / f"vit-rollout{suffix}"))
    return written


def run(args: argparse.Namespace) -> int:
    loaded = load_run(args.run_dir)
    scene = SCENES[loaded.task](loaded, args)
    path = write_page(args.output, scene.views, mode=scene.mode, image=scene.image,
                      threshold=args.threshold, title=f"qkv attention: {loaded.path.name}")
    print(f"attention page: {path}")
    if args.png:
        for picture in write_pictures(scene, args.png, ".svg" if args.svg else ".png"):
            print(f"picture: {picture}")
    return 0
