"""Each lm run's attention on held-out text, per layer, from the viewer's summaries
(``qkv.viz.summaries``): mean entropy (bits), mean mass on the first token (the sink) and
mean attention distance (tokens), over every head and query row 1.. of the first ``WINDOWS``
held-out windows; and the held-out text's unigram entropy, the loss of a model that reads
no context.

Row 0 is left out: under a causal mask it sees only itself, entropy 0 and sink mass 1
whatever the model learned. A differential layer is summarized over its 2H softmax maps
(A_2h and A_2h+1): their difference is no distribution, so it has no entropy.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import torch

from ..data.atomic import write_json_atomic
from ..train.rundir import load_run
from ..train.tasks.lm import corpus
from ..viz.scene import without_head
from ..viz.summaries import summarize

WINDOWS = 8
MARK = "attention.json"  # a run's summaries, kept so a rerun of the lab reads them back
STATS = ("entropy_bits", "sink", "distance")


def unigram_entropy(ids: list[int], reference: list[int]) -> float:
    """Cross-entropy (nats/token) of ``ids`` under the unigram frequencies of ``reference``
    with add-one smoothing over the tokens either holds."""
    counts = Counter(reference)
    vocab = set(counts) | set(ids)
    total = len(reference) + len(vocab)
    return -sum(math.log((counts[t] + 1) / total) for t in ids) / len(ids)


def held_out(run) -> tuple[list[int], list[int]]:
    """(training ids, held-out ids) of the run's text, with its tokenizer."""
    tok = run.tokenizers["tokenizer"]
    train_text, test_text = corpus(run.config.data)
    return tok.encode(train_text), tok.encode(test_text)


def layer_means(per_window: list[dict]) -> list[dict]:
    """[{layer name: HeadStats}] -> per layer, in model order, the means of ``STATS``."""
    layers = []
    for name in per_window[0]:
        sums = dict.fromkeys(STATS, 0.0)
        count = 0
        for stats in per_window:
            s = stats[name]  # entropy, sink, distance: (heads, N) per query row
            sums["entropy_bits"] += float(s.entropy[:, 1:].double().sum())
            sums["sink"] += float(s.sink[:, 1:].double().sum())
            sums["distance"] += float(s.distance[:, 1:].double().sum())
            count += s.entropy[:, 1:].numel()
        layers.append({"layer": name, **{k: v / count for k, v in sums.items()}})
    return layers


def run_summary(run_dir: Path) -> dict:
    """The run's summaries: {"layers": [{layer, entropy_bits, sink, distance}], "tokens",
    "unigram_entropy"}; read from ``RUN/attention.json`` once written."""
    path = run_dir / MARK
    if path.is_file():
        return json.loads(path.read_text())
    run = load_run(run_dir)
    model, block = run.model, run.model.config.block_size
    train_ids, test_ids = held_out(run)
    windows = [test_ids[i:i + block] for i in range(0, len(test_ids) - block + 1, block)]
    windows = windows[:WINDOWS]
    if not windows:
        raise ValueError(f"{run_dir}: the held-out text holds no window of {block} tokens")
    per_window = []
    for ids in windows:
        x = torch.tensor([ids])  # (1, block)
        with without_head(model):
            per_window.append(summarize(model, lambda x=x: model(x)))
    scored = [t for w in windows for t in w]
    summary = {"layers": layer_means(per_window), "tokens": len(scored),
               "unigram_entropy": unigram_entropy(test_ids, train_ids)}
    write_json_atomic(path, summary)
    return summary


def mean_over_seeds(summaries: list[dict]) -> list[dict]:
    """Per layer, each of ``STATS`` averaged over the seeds' summaries."""
    layers = []
    for i, first in enumerate(summaries[0]["layers"]):
        layers.append({"layer": first["layer"],
                       **{k: sum(s["layers"][i][k] for s in summaries) / len(summaries)
                          for k in STATS}})
    return layers
