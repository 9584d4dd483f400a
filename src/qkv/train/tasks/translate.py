"""translate: the encoder-decoder Transformer on sentence pairs.

Embedded default: German number words -> English number words (``qkv.data.numbers``).
User data: ``data.path`` names a TSV of ``source<TAB>target`` lines.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...data.numbers import pairs, split_numbers
from ...data.text import read_pairs_tsv, split_pairs
from ...data.tokenizers import BOS_ID, EOS_ID, PAD_ID
from ...models import Transformer, TransformerConfig
from ..config import SEEDS, Schema, limited
from .common import build, run_tokenizer

IGNORE = -100


@dataclass
class TranslateData:
    path: str = ""  # a TSV of source<TAB>target lines; empty: the embedded number task
    train_size: int = limited(30000, "[1, inf)")  # embedded task: training numbers
    # Embedded task: held-out numbers (never in training).
    test_size: int = limited(500, "[1, inf)")
    test_fraction: float = limited(0.1, "(0, 1)")  # user TSV: the held-out share
    split_seed: int = limited(0, SEEDS)
    tokenizer: str = limited("bpe", choices=("bpe", "char"))
    src_vocab_size: int = limited(100, "[5, inf)")  # bpe only; the 4 special tokens and more
    tgt_vocab_size: int = limited(100, "[5, inf)")
    max_len: int = limited(64, "[1, inf)")  # tokens per side; longer training pairs are dropped


@dataclass
class TranslateEval:
    # The final evaluation and `qkv translate`; during training: greedy.
    beam_size: int = limited(4, "[1, inf)")
    length_penalty: float = limited(0.6, "[0, inf)")
    # Held-out examples scored during training (the final eval uses all).
    max_examples: int = limited(200, "[1, inf)")
    batch_size: int = limited(128, "[1, inf)")


PRESETS = {
    "default": {
        "model.block.d_model": 128, "model.block.n_head": 4, "model.n_encoder_layers": 2,
        "model.n_decoder_layers": 2, "model.block.d_ff": 512, "model.block.dropout": 0.0,
        "model.block.norm_first": True,
        "train.steps": 500, "train.batch_size": 128, "train.lr": 2e-3, "train.warmup": 100,
        "train.label_smoothing": 0.1, "train.eval_every": 250, "train.checkpoint_every": 100,
        "train.log_every": 25,
        # Small matrices gain little from a second thread, and lose badly when the two
        # cores are shared (OpenMP threads wait on each other).
        "train.threads": 1,
    },
    "tiny": {
        "data.train_size": 400, "data.test_size": 16, "data.src_vocab_size": 60,
        "data.tgt_vocab_size": 60, "eval.beam_size": 2, "eval.max_examples": 8,
        "model.block.d_model": 32, "model.block.n_head": 2, "model.n_encoder_layers": 1,
        "model.n_decoder_layers": 1, "model.block.d_ff": 64, "model.block.dropout": 0.0,
        "train.steps": 6, "train.batch_size": 16, "train.warmup": 2,
        "train.checkpoint_every": 3, "train.log_every": 2,
    },
}


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


class PairData:
    """Tokenized pairs and the held-out raw text; ``batch`` pads a set of training rows."""

    unit = "tok"

    def __init__(self, src_tok, tgt_tok, train_pairs, test_pairs, max_len: int,
                 new_files: dict[str, dict]):
        self.src_tok, self.tgt_tok, self.test_pairs = src_tok, tgt_tok, test_pairs
        self.new_files = new_files
        encoded = [(src_tok.encode(s), tgt_tok.encode(t)) for s, t in train_pairs]
        self.train = [(s, t) for s, t in encoded if len(s) <= max_len and len(t) < max_len]
        self.targets = torch.tensor([len(t) + 1 for _, t in self.train], dtype=torch.long)
        self.train_size = len(self.train)

    def weight(self, index: torch.Tensor) -> int:
        """Target tokens (with eos) in the rows ``index``: what the summed loss counts."""
        return int(self.targets[index].sum())

    def batch(self, index: torch.Tensor, device) -> dict:
        rows = [self.train[i] for i in index.tolist()]
        src = [s for s, _ in rows]
        return {
            "src": pad(src, PAD_ID).to(device),
            "src_lengths": torch.tensor([len(s) for s in src], device=device),
            "tgt_in": pad([[BOS_ID] + t for _, t in rows], PAD_ID).to(device),
            "tgt_out": pad([t + [EOS_ID] for _, t in rows], IGNORE).to(device),
            "tgt_lengths": torch.tensor([len(t) + 1 for _, t in rows], device=device),
        }

    def units(self, batch: dict) -> int:
        return int(batch["tgt_lengths"].sum() + batch["src_lengths"].sum())


def embedded_or_user_pairs(data: TranslateData):
    """(train pairs as a function, held-out pairs): the embedded training words are only
    generated when needed (training, or a tokenizer still to learn)."""
    if data.path:
        train, test = split_pairs(read_pairs_tsv(data.path), data.test_fraction, data.split_seed)
        return (lambda: train), test
    train_numbers, test_numbers = split_numbers(data.train_size, data.test_size, data.split_seed)
    return (lambda: pairs(train_numbers)), pairs(test_numbers)


def translate_batch(model, tgt_tok, src_tok, sources: list[str], beam_size: int,
                    length_penalty: float, max_len: int) -> list[str]:
    """Translate ``sources`` with greedy (beam_size 1) or beam search; returns the texts."""
    device = next(model.parameters()).device
    ids = [src_tok.encode(s)[:max_len] or [src_tok.unk_id] for s in sources]
    out = model.generate(
        pad(ids, PAD_ID).to(device), src_lengths=torch.tensor([len(i) for i in ids], device=device),
        max_new_tokens=max_len, bos_id=BOS_ID, eos_id=EOS_ID, beam_size=beam_size,
        length_penalty=length_penalty,
    )
    texts = []
    for row in out.tolist():
        end = row.index(EOS_ID) if EOS_ID in row else len(row)
        texts.append(tgt_tok.decode(row[:end]))
    return texts


class TranslateTask:
    name = "translate"
    presets = PRESETS

    @property
    def schema(self) -> Schema:
        derived = {"src_vocab_size": 100, "tgt_vocab_size": 100, "pad_id": PAD_ID,
                   "bos_id": BOS_ID, "eos_id": EOS_ID, "max_len": 66}
        return Schema(TranslateData, TranslateEval, TransformerConfig, derived)

    def prepare(self, cfg, run_dir: Path | None, env, train: bool = True) -> PairData:
        make_train_pairs, test_pairs = embedded_or_user_pairs(cfg.data)
        train_pairs = functools.cache(make_train_pairs)

        d = cfg.data
        new_files = {}
        src_tok = run_tokenizer(run_dir, "tokenizer_src", env, d.tokenizer,
                                lambda: [s for s, _ in train_pairs()], d.src_vocab_size,
                                new_files)
        tgt_tok = run_tokenizer(run_dir, "tokenizer_tgt", env, d.tokenizer,
                                lambda: [t for _, t in train_pairs()], d.tgt_vocab_size,
                                new_files)
        return PairData(src_tok, tgt_tok, train_pairs() if train else [], test_pairs, d.max_len,
                        new_files)

    def build_model(self, cfg, data: PairData):
        derived = {
            "src_vocab_size": data.src_tok.vocab_size, "tgt_vocab_size": data.tgt_tok.vocab_size,
            "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID, "max_len": cfg.data.max_len + 2,
        }
        return build(Transformer, TransformerConfig, derived, cfg.model)

    def loss_sum(self, model, batch: dict, train_cfg) -> torch.Tensor:
        logits = model(batch["src"], batch["tgt_in"], src_lengths=batch["src_lengths"],
                       tgt_lengths=batch["tgt_lengths"])
        return F.cross_entropy(
            logits.flatten(0, 1).float(), batch["tgt_out"].flatten(), ignore_index=IGNORE,
            label_smoothing=train_cfg.label_smoothing, reduction="sum",
        )

    def translate(self, model, data: PairData, cfg, sources: list[str], beam_size: int):
        out = []
        step = cfg.eval.batch_size
        for i in range(0, len(sources), step):
            out += translate_batch(model, data.tgt_tok, data.src_tok, sources[i : i + step],
                                   beam_size, cfg.eval.length_penalty, cfg.data.max_len)
        return out

    def evaluate(self, model, data: PairData, cfg, final: bool) -> dict:
        """Held-out exact match (%), chrF and BLEU (sacrebleu), and the share (%) of references
        shorter than 4 tokens (sacrebleu's 13a tokens); beam search when final."""
        import sacrebleu
        from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a

        pairs = data.test_pairs if final else data.test_pairs[: cfg.eval.max_examples]
        beam = cfg.eval.beam_size if final else 1
        hyps = self.translate(model, data, cfg, [s for s, _ in pairs], beam)
        refs = [t for _, t in pairs]
        exact = sum(h == r for h, r in zip(hyps, refs, strict=True)) / len(refs)
        tokenize = Tokenizer13a()
        short = sum(len(tokenize(r).split()) < 4 for r in refs) / len(refs)
        return {
            "exact_match": 100 * exact,
            "chrf": sacrebleu.corpus_chrf(hyps, [refs]).score,
            "bleu": sacrebleu.corpus_bleu(hyps, [refs]).score,
            "short_references": 100 * short,
            "examples": len(refs), "beam_size": beam,
        }

    def summary(self, result: dict) -> str:
        """Exact match and chrF first; BLEU, which scores matching 4-grams, is 0 by
        construction on a reference shorter than 4 tokens, and says so when most are."""
        r = result
        bleu = f"BLEU {r['bleu']:.1f}"
        if r["short_references"] > 50:
            bleu += (f" (of little meaning here: {r['short_references']:.0f}% of the references "
                     "are shorter than 4 tokens, where BLEU is 0 by construction)")
        return (f"held-out exact match {r['exact_match']:.1f}% | chrF {r['chrf']:.1f} | {bleu} "
                f"({r['examples']} examples, beam {r['beam_size']})")

    def report(self, model, data: PairData, cfg, run_dir: Path, out, heatmap=None) -> None:
        """Five held-out translations and, with ``heatmap`` (``qkv.viz.heatmap``'s
        ``cross_attention_png``, passed in by the command: ``train`` does not import the
        viewer), a cross-attention heatmap of the first one."""
        pairs = data.test_pairs[:5]
        hyps = self.translate(model, data, cfg, [s for s, _ in pairs], cfg.eval.beam_size)
        for (src, ref), hyp in zip(pairs, hyps, strict=True):
            mark = "ok " if hyp == ref else "ERR"
            print(f"  {mark} {src} -> {hyp}" + ("" if hyp == ref else f"   (expected {ref})"),
                  file=out)
        if heatmap is None:
            return
        kind = model.config.block.attention
        if kind != "multihead":
            print(f"no cross-attention heatmap: attention={kind!r} forms no attention weights",
                  file=out)
            return
        path = heatmap(model, data.src_tok, data.tgt_tok, pairs[0][0], hyps[0],
                                   run_dir / "cross_attention.png")
        print(f"cross-attention heatmap: {path}", file=out)
