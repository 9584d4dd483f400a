"""CPU training throughput: qkv's GPT versus a plain-PyTorch GPT of the same shape.

nanoGPT's small CPU configuration: 4 layers, 4 heads, d_model 128, context 64, dropout 0,
character-level vocabulary of the standard library's docstrings (the `qkv train lm` data).
Both models take full AdamW training steps (forward, backward, update) on the same batches,
alternating in rounds so both see the same machine load; the table reports the median
tokens/s of each and the ratio qkv / plain (> 1 means qkv is faster).

    python benchmarks/train_cpu.py                     # batch 12 (nanoGPT's), 5 rounds
    python benchmarks/train_cpu.py --batch-size 32 --rounds 9 --threads 1
    qkv bench train -- --rounds 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from qkv.bars import bar
from qkv.data.docstrings import stdlib_docstrings
from qkv.data.tokenizers import CharTokenizer
from qkv.models import GPT, GPTConfig

N_LAYER, N_HEAD, D_MODEL, BLOCK = 4, 4, 128, 64


class PlainBlock(nn.Module):
    """Pre-norm block: LayerNorm, causal SDPA attention (fused QKV), LayerNorm, GELU MLP."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, self.n_head, d // self.n_head).unbind(2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, n, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class PlainGPT(nn.Module):
    """nanoGPT's model, written directly on torch (learned positions, tied head)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, D_MODEL)
        self.pos = nn.Embedding(BLOCK, D_MODEL)
        self.blocks = nn.ModuleList(PlainBlock(D_MODEL, N_HEAD) for _ in range(N_LAYER))
        self.ln = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def batches(ids: torch.Tensor, batch_size: int, count: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.arange(BLOCK + 1)
    for _ in range(count):
        starts = torch.randint(0, len(ids) - BLOCK - 1, (batch_size,), generator=g)
        w = ids[starts[:, None] + offsets]
        yield w[:, :-1], w[:, 1:]


def train_steps(model: nn.Module, optimizer, data) -> tuple[float, int, float]:
    """(seconds, tokens, last loss) for the given batches."""
    tokens, loss = 0, torch.tensor(0.0)
    start = time.perf_counter()
    for x, y in data:
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tokens += y.numel()
    return time.perf_counter() - start, tokens, loss.item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=12)
    p.add_argument("--steps", type=int, default=20, help="training steps per model per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = CharTokenizer.train([stdlib_docstrings()])
    ids = torch.tensor(tok.encode(stdlib_docstrings()), dtype=torch.long)
    torch.manual_seed(0)
    models = {
        "qkv GPT": GPT(GPTConfig(vocab_size=tok.vocab_size, block_size=BLOCK, n_layer=N_LAYER,
                                 block={"n_head": N_HEAD, "d_model": D_MODEL})),
        "plain PyTorch GPT": PlainGPT(tok.vocab_size),
    }
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    rates: dict[str, list[float]] = {k: [] for k in models}
    for name, model in models.items():  # warm-up round, not timed
        train_steps(model, optimizers[name], batches(ids, args.batch_size, 3, seed=0))
    for r in bar(range(args.rounds), desc="rounds", unit="round"):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            data = list(batches(ids, args.batch_size, args.steps, seed=r + 1))
            seconds, tokens, _ = train_steps(models[name], optimizers[name], data)
            rates[name].append(tokens / seconds)
    params = {k: sum(p.numel() for p in m.parameters()) for k, m in models.items()}
    print(f"GPT training step, CPU: {N_LAYER} layers, {N_HEAD} heads, d_model {D_MODEL}, "
          f"context {BLOCK}, vocab {tok.vocab_size}, batch {args.batch_size}, float32, "
          f"AdamW; {args.rounds} rounds x {args.steps} steps, median")
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{platform.processor() or platform.machine()}, python {platform.python_version()}")
    print(f"{'model':<20}{'params':>10}{'tokens/s':>12}")
    for name in models:
        print(f"{name:<20}{params[name]:>10,}{statistics.median(rates[name]):>12,.0f}")
    ratio = statistics.median(rates["qkv GPT"]) / statistics.median(rates["plain PyTorch GPT"])
    print(f"ratio qkv / plain: {ratio:.3f}x (target >= 0.95x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
