"""Using a loaded checkpoint: sentence embeddings, perplexity, and streamed text."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def embed_texts(encoder, tokenizer, texts: Sequence[str], batch_size: int = 32) -> Tensor:
    """Sentence embeddings (len(texts), d_model) of a BERT-family ``encoder``, pooled (and
    normalized) as its checkpoint says, each text truncated to the checkpoint's limit."""
    limit = min(tokenizer.max_length or encoder.config.max_len, encoder.config.max_len)
    pad = tokenizer.pad_id or 0
    chunks = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            rows = [tokenizer.encode(t, max_length=limit) for t in texts[start:start + batch_size]]
            lengths = torch.tensor([len(r) for r in rows])
            ids = torch.full((len(rows), int(lengths.max())), pad, dtype=torch.long)
            for i, r in enumerate(rows):
                ids[i, :len(r)] = torch.tensor(r)
            chunks.append(encoder.embed(ids, lengths=lengths))
    return torch.cat(chunks)


def cosine_matrix(vectors: Tensor) -> Tensor:
    """(n, d) -> (n, n) cosine similarities."""
    unit = F.normalize(vectors, dim=-1)
    return unit @ unit.T


def token_nll(model, ids: Tensor, window: int, batch_size: int = 8) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of a token stream ids (N,) under a GPT, and the
    number of tokens scored. The stream is cut into non-overlapping windows of ``window``
    tokens; each window's first token is context only."""
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens; got {window}")
    pieces = [ids[s:s + window + 1] for s in range(0, len(ids) - 1, window)]
    full = [p for p in pieces if len(p) == window + 1]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)]
    groups += [[p] for p in pieces if 1 < len(p) < window + 1]  # the stream's short tail
    total, count = 0.0, 0
    with torch.no_grad():
        for group in groups:
            x = torch.stack(group)
            logits = model(x[:, :-1])
            total += float(F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten(),
                                           reduction="sum"))
            count += x[:, 1:].numel()
    return total, count


def perplexity(total_nll: float, count: int) -> float:
    return math.exp(total_nll / max(1, count))


class TextStream:
    """Turns tokens arriving one by one into text pieces, holding back a piece until its
    bytes form whole characters (byte-level BPE can split a character across tokens)."""

    def __init__(self, tokenizer, write: Callable[[str], None]):
        self.tokenizer, self.write = tokenizer, write
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, token: Tensor) -> None:
        self.ids.append(int(token.reshape(-1)[0]))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.write(text[self.shown:])
        self.shown = len(text)

    def text(self) -> str:
        return self.tokenizer.decode(self.ids)
