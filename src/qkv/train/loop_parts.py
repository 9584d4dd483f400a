"""The parts of the training loop that hold no trainer state: the stream of global batches
(``Stream``), the AdamW optimizer with weight decay on matrices only, the RNG state a
checkpoint stores and restores, autocast for ``train.precision``, and the peak memory a run's
result gives."""

from __future__ import annotations

import contextlib
import random
import sys
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")


class Stream:
    """Global batches of ``batch_size`` example indices out of ``n``, epoch after epoch."""

    def __init__(self, n: int, batch_size: int, seed: int):
        if n < batch_size:
            raise ValueError(f"train.batch_size: {batch_size} exceeds the {n} training examples")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.per_epoch = n // batch_size
        self.epoch, self.order = -1, None

    def indices(self, micro_step: int) -> torch.Tensor:
        epoch, position = divmod(micro_step, self.per_epoch)
        if epoch != self.epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self.order, self.epoch = torch.randperm(self.n, generator=generator), epoch
        return self.order[position * self.batch_size : (position + 1) * self.batch_size]


def make_optimizer(model: torch.nn.Module, cfg) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases, norms or 1-D parameters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def autocast(cfg, device: torch.device):
    if cfg.precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if cfg.precision != "fp32":
        raise ValueError(f"train.precision: expected fp32 or bf16, got {cfg.precision!r}")
    return contextlib.nullcontext()


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over, so that it measures what follows (in a process that trained
    before, or built a model first). On Linux, writing 5 to clear_refs resets the resident
    peak, VmHWM."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass  # elsewhere the process's peak so far is what there is


def peak_memory_bytes(device: torch.device) -> int:
    """The GPU's peak allocation, or on the CPU the process's peak resident size (since
    ``reset_peak_memory``, on Linux)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if STATUS.exists():
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes there, else kilobytes
