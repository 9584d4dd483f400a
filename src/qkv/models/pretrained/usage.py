"""Using a loaded checkpoint: sentence embeddings and streamed text."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence


def embed_texts(encoder, tokenizer, texts: Sequence[str], batch_size: int = 32) -> Tensor:
    """Sentence embeddings (len(texts), d_model) of a BERT-family ``encoder``, pooled (and
    normalized) as its checkpoint says, each text truncated to the checkpoint's limit."""
    limit = min(tokenizer.max_length or encoder.config.max_len, encoder.config.max_len)
    pad = tokenizer.pad_id or 0
    chunks = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            rows = [torch.tensor(tokenizer.encode(t, max_length=limit))
                    for t in texts[start:start + batch_size]]
            lengths = torch.tensor([len(r) for r in rows])
            ids = pad_sequence(rows, batch_first=True, padding_value=pad)
            chunks.append(encoder.embed(ids, lengths=lengths))
    return torch.cat(chunks)


def cosine_matrix(vectors: Tensor) -> Tensor:
    """(n, d) -> (n, n) cosine similarities."""
    unit = F.normalize(vectors, dim=-1)
    return unit @ unit.T


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
