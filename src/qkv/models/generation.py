"""Decoding loops shared by the GPT and the encoder-decoder: sampling and beam search.

Both loops drive a ``step(tokens (B, n)) -> logits (B, V)`` function that feeds the new
tokens to the model (through its cache, or by recomputing the whole prefix) and returns the
logits for the next position. Beam search also reorders the model's state through
``reorder(index)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Step = Callable[[Tensor], Tensor]


class ModelCache:
    """The per-layer caches of one model and the number of positions already processed."""

    def __init__(self, layers: list):
        self.layers = layers
        self.length = 0

    def reorder(self, index: Tensor) -> None:
        for layer in self.layers:
            for cache in layer if isinstance(layer, tuple) else (layer,):
                cache.reorder(index)


def stepper(run: Callable[[Tensor, ModelCache | None], Tensor], cache: ModelCache | None):
    """Build step(tokens) -> next-token logits (B, V) and reorder(index) from
    ``run(tokens (B, n), cache) -> logits (B, n, V)``: through ``cache`` when given, otherwise
    by recomputing the whole prefix each step (the uncached reference)."""
    if cache is not None:
        return (lambda tokens: run(tokens, cache)[:, -1]), cache.reorder
    history: list[Tensor] = []

    def step(tokens: Tensor) -> Tensor:
        seq = tokens if not history else torch.cat((history.pop(), tokens), dim=1)
        history.append(seq)
        return run(seq, None)[:, -1]

    def reorder(index: Tensor) -> None:
        history.append(history.pop().index_select(0, index))

    return step, reorder


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0 (0 = greedy); got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1; got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be None or in (0, 1]; got {top_p!r}")


def filter_logits(logits: Tensor, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Set to -inf every logit outside the top k, and outside the smallest set of most likely
    tokens whose probability reaches top_p (nucleus). logits (B, V) -> (B, V)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def choose_next(
    logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
    top_p: float | None = None, generator: torch.Generator | None = None,
) -> Tensor:
    """The next token (B,) from logits (B, V): argmax when temperature == 0, else a sample
    from softmax(filtered logits / temperature)."""
    if temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float() / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def sample(
    step: Step, first: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
    top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
    generator: torch.Generator | None = None, on_token: Callable[[Tensor], None] | None = None,
) -> Tensor:
    """Greedy or sampled decoding. first (B, n) is fed to ``step`` first. Returns (B, T),
    T <= max_new_tokens: it stops once every row has produced eos_id, and rows that finished
    earlier are filled with eos_id. ``on_token(token (B,))`` sees each step's tokens as they
    are chosen (streaming)."""
    logits = step(first)
    finished = torch.zeros(first.shape[0], dtype=torch.bool, device=first.device)
    out = []
    for t in range(max_new_tokens):
        token = choose_next(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            token = token.masked_fill(finished, eos_id)
            finished = finished | (token == eos_id)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        logits = step(token[:, None])
    return torch.stack(out, dim=1) if out else first.new_zeros(first.shape[0], 0)


def length_penalty_of(length: Tensor, alpha: float) -> Tensor:
    """GNMT's length penalty ((5 + |Y|) / 6)^alpha (Wu et al. 2016; alpha=0.6 in the paper)."""
    return ((5.0 + length.float()) / 6.0) ** alpha


def beam_search(
    step: Step, reorder: Callable[[Tensor], None], first: Tensor, batch: int, beam_size: int,
    max_new_tokens: int, *, eos_id: int | None = None, length_penalty: float = 1.0,
) -> Tensor:
    """Beam search. first (batch * beam_size, n) holds each input repeated beam_size times.

    Every beam keeps its summed log-probability; a beam that produced eos_id is frozen (it
    can only extend with eos at no cost). The result per input is the beam with the best
    score / ((5 + length) / 6)^length_penalty, length counting tokens up to its first eos.
    Returns (batch, T) token ids, T <= max_new_tokens, eos-filled after each row's end."""
    k = beam_size
    device = first.device
    logits = step(first)
    vocab = logits.shape[-1]
    scores = torch.zeros(batch, k, device=device)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    seqs = first.new_zeros(batch * k, 0)
    finished = torch.zeros(batch * k, dtype=torch.bool, device=device)
    lengths = torch.zeros(batch * k, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device).unsqueeze(1) * k
    for t in range(max_new_tokens):
        logp = F.log_softmax(logits.float(), dim=-1)
        if eos_id is not None:
            frozen = torch.full_like(logp, float("-inf"))
            frozen[:, eos_id] = 0.0
            logp = torch.where(finished.unsqueeze(1), frozen, logp)
        candidates = (scores.reshape(-1, 1) + logp).reshape(batch, k * vocab)
        scores, flat = candidates.topk(k, dim=-1)
        index = (rows + flat // vocab).reshape(-1)
        token = (flat % vocab).reshape(-1)
        seqs = torch.cat((seqs[index], token.unsqueeze(1)), dim=1)
        lengths = lengths[index] + (~finished[index]).long()
        finished = finished[index] | (token == eos_id if eos_id is not None else False)
        if t == max_new_tokens - 1 or bool(finished.all()):
            break
        reorder(index)
        logits = step(token.unsqueeze(1))
    final = scores / length_penalty_of(lengths.view(batch, k), length_penalty)
    best = rows.squeeze(1) + final.argmax(-1)
    return seqs[best]


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[None]:
    """Run a block in eval mode (no dropout), then restore the module's training flag."""
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def decode(
    step: Step, reorder: Callable[[Tensor], None], first: Tensor, batch: int, max_new_tokens: int,
    *, beam_size: int = 1, length_penalty: float = 1.0, temperature: float = 1.0,
    top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None,
    generator: torch.Generator | None = None, on_token: Callable[[Tensor], None] | None = None,
) -> Tensor:
    """Beam search when beam_size > 1 (``first`` then holds batch * beam_size rows), else greedy
    or sampled decoding (``on_token`` streams its tokens; see ``sample``). Returns (batch, T)
    new tokens."""
    check_sampling(temperature, top_k, top_p)
    if not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be an int >= 1; got {beam_size!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0; got {max_new_tokens!r}")
    if beam_size > 1 and on_token is not None:
        raise ValueError("streaming (on_token) needs beam_size 1: beams change until the end")
    if beam_size > 1:
        return beam_search(
            step, reorder, first, batch, beam_size, max_new_tokens, eos_id=eos_id,
            length_penalty=length_penalty,
        )
    return sample(
        step, first, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
        eos_id=eos_id, generator=generator, on_token=on_token,
    )
